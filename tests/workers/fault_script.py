"""A training process for tests/test_faults.py to SIGKILL at a known moment.

    python tests/workers/fault_script.py MOMENT ROOT

Prints "writer <pid>", then "at <MOMENT>" once it is there, then blocks on stdin
until the test kills it. MOMENT: constructed (host buffers still being allocated
and announced), mid-copy (a replay window open), mid-persist (the writer inside a
shard write; the store blocks there).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers, fakes
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository

from overlapckpt.seams import Checkpointer  # noqa: E402
from overlapckpt.train.copying.cpu_copier import CpuCopier  # noqa: E402

from fakes import BLOCK_FIFO_ENV, BlockingStore  # noqa: E402
from helpers import make_run, train_step  # noqa: E402


def main() -> None:
    moment, root = sys.argv[1], sys.argv[2]
    model, opt, sched, sampler = make_run(width=512)
    train_step(model, opt, sched, sampler)  # the state exists: buffers are allocated at construction
    # Copies at the call: each snapshot is complete, and handed to the writer, at a known hook.
    ckpt = Checkpointer(model, opt, root, window=3, consistency="replay", store_class=BlockingStore, copier=CpuCopier())
    print(f"writer {ckpt.writer_pid}", flush=True)
    if moment == "mid-copy":
        train_step(model, opt, sched, sampler)
        ckpt.request()
        ckpt.step()
        train_step(model, opt, sched, sampler)
        ckpt.step()
    elif moment == "mid-persist":
        # The Checkpointer counts the steps it sees: requests after its steps 1 and 4 hold
        # versions 3 (commits) and 6 (its shard write blocks: ONLY_NAME).
        for request_at in (1, 4):
            for step in range(request_at, request_at + 3):
                train_step(model, opt, sched, sampler)
                if step == request_at:
                    ckpt.request()
                ckpt.step()
            if request_at == 1:
                ckpt.wait(timeout_s=120)
        train_step(model, opt, sched, sampler)  # its pre-hook hands version 6 to the writer
        with open(os.environ[BLOCK_FIFO_ENV]) as f:
            f.readline()
    print(f"at {moment}", flush=True)
    sys.stdin.readline()  # until killed


if __name__ == "__main__":
    main()
