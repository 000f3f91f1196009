"""One training process of a fault-schedule trial (tests/fault_schedule.py): argv ROOT CONFIG_JSON.

It resumes from the root's newest checkpoint if there is one (``load()``, then a
Checkpointer that continues its count), trains to ``steps`` with the trial's mode, and
injects the trainer-side faults at their steps, each once (fakes.fire_once): SIGKILL of
its writer, or of itself. The writer-side faults (inside persist, inside replay) come
from tests/fakes.py through the environment. Prints "done" after close().
"""

from __future__ import annotations

import json
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers, fakes

import torch  # noqa: E402
from fault_schedule import make_trial_run, trial_step  # noqa: E402

from overlapckpt import Checkpointer, list_checkpoints, load  # noqa: E402

from fakes import TRAINER_PID_ENV, FaultStore, fire_once  # noqa: E402


def main() -> None:
    root, config = sys.argv[1], json.loads(sys.argv[2])
    os.environ[TRAINER_PID_ENV] = str(os.getpid())  # the writer-side fakes act in other processes only
    torch.set_num_threads(1)
    model, opt, sched, sampler = make_trial_run()
    stateful = {"sched": sched, "sampler": sampler}
    start = 0
    if list_checkpoints(root):
        trial_step(model, opt, sched, sampler, count=False)  # the optimizer state load() reads into
        start = load(root, model, opt, stateful=stateful).step
    with Checkpointer(model, opt, root, window=config["window"], consistency=config["consistency"], every=config["every"],
                      keep=config["keep"], stateful=stateful, store_class=FaultStore) as ckpt:
        assert ckpt.step_count == start, (ckpt.step_count, start)
        for s in range(start + 1, config["steps"] + 1):
            trial_step(model, opt, sched, sampler)
            ckpt.step()
            for fault in config["trainer_faults"]:
                if fault["at_step"] == s and fire_once(fault["id"]):
                    if fault["kind"] == "kill-writer":
                        os.kill(ckpt.writer_pid, signal.SIGKILL)
                    else:
                        os.kill(os.getpid(), signal.SIGKILL)
        ckpt.wait(timeout_s=120)
    print("done", flush=True)


if __name__ == "__main__":
    main()
