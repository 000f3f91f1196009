"""Run by test_resume.py in fresh processes: train, checkpoint, or restore and continue."""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers, fakes

from overlapckpt import Checkpointer  # noqa: E402

from helpers import make_run, train_step  # noqa: E402


def main() -> None:
    mode, steps, path, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    window = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    consistency = sys.argv[6] if len(sys.argv) > 6 else "replay"
    request_at = int(sys.argv[7]) if len(sys.argv) > 7 else 0
    torch.set_num_threads(1)
    model, opt, sched, sampler = make_run(seed=0 if mode != "resume" else 1234)
    stateful = {"scheduler": sched, "sampler": sampler}
    losses: dict[int, float] = {}
    if mode == "full":
        for step in range(1, steps + 1):
            losses[step] = train_step(model, opt, sched, sampler)
    elif mode == "save":
        with Checkpointer(model, opt, path, window=window, consistency=consistency, stateful=stateful) as ckpt:
            for step in range(1, steps + 1):
                losses[step] = train_step(model, opt, sched, sampler)
                if step == request_at:
                    ckpt.request()
                ckpt.step()
            infos = ckpt.wait(timeout_s=120)
        losses[-1] = infos[0].step
    elif mode == "resume":
        with Checkpointer(model, opt, path, window=window, consistency=consistency, stateful=stateful) as ckpt:
            start = ckpt.restore().step
            for step in range(start + 1, steps + 1):
                losses[step] = train_step(model, opt, sched, sampler)
                ckpt.step()
    with open(out, "w") as f:
        json.dump({str(k): v for k, v in losses.items()}, f)


if __name__ == "__main__":
    main()
