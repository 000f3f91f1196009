"""A training process for tests/test_preemption.py: save_on_signal=(SIGTERM,), replay W=4.

    python tests/workers/preempt_script.py ROOT HOW [LOCAL_DIR [local-only-at-5]]

Prints "step N" after each iteration. HOW: "outside" (the test sends SIGTERM, twice,
while the loop runs) or "inside-hook" (a hook inside optimizer.step() sends it to
this process at step 5, twice). Trains at most 200 steps; without a signal it exits 0.
LOCAL_DIR: a node-local tier too (local_every=100: only the preemption's checkpoint reaches it).
local-only-at-5: window 1, local_every=5 and no request at step 3, so the signal's step is
covered by a checkpoint of the local tier alone.
"""

from __future__ import annotations

import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers, fakes
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository

import torch  # noqa: E402

from overlapckpt import Checkpointer  # noqa: E402

from helpers import make_run, train_step  # noqa: E402


def main() -> None:
    root, how = sys.argv[1], sys.argv[2]
    tier = {"local_every": 100, "local_dir": sys.argv[3]} if len(sys.argv) > 3 else {}
    local_only_at_5 = len(sys.argv) > 4 and sys.argv[4] == "local-only-at-5"
    if local_only_at_5:
        tier["local_every"] = 5
    torch.set_num_threads(1)  # as the twin in the test: results are bit-identical only at the same thread count
    model, opt, sched, sampler = make_run()
    ckpt = Checkpointer(
        model, opt, root, window=1 if local_only_at_5 else 4, consistency="replay", stateful={"sched": sched}, save_on_signal=(signal.SIGTERM,), signal_grace_s=60,
        **tier,
    )
    steps = [0]
    if how == "inside-hook":
        def kill_inside(*args):
            if steps[0] == 4:  # inside the 5th optimizer.step(), between overlapckpt's hooks
                os.kill(os.getpid(), signal.SIGTERM)
                os.kill(os.getpid(), signal.SIGTERM)
        opt.register_step_pre_hook(kill_inside)
    for it in range(1, 201):
        train_step(model, opt, sched, sampler)
        steps[0] = it
        if it == 3 and not local_only_at_5:
            ckpt.request()  # a replay window open over steps 3..6
        ckpt.step()
        print(f"step {it}", flush=True)
        if how == "outside" and it >= 4:
            sys.stdin.readline()  # the test answers each step, so the signal lands inside the window
    ckpt.close()


if __name__ == "__main__":
    main()
