"""For tests/test_writer_process.py: one checkpoint, run from a working directory the test chose.

    python tests/workers/writer_cwd_script.py ROOT

tests/ and the repository are on sys.path; the cwd is not
(a script's sys.path[0] is its directory). Prints the writer's pid and "committed N".
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers, fakes

from overlapckpt import Checkpointer  # noqa: E402

from helpers import make_run, train_step  # noqa: E402


def main() -> None:
    model, opt, sched, sampler = make_run()
    with Checkpointer(model, opt, sys.argv[1]) as ckpt:
        for _ in range(2):
            train_step(model, opt, sched, sampler)
            ckpt.step()
        ckpt.request()
        (info,) = ckpt.wait(timeout_s=120)
        print(f"writer {ckpt.writer_pid} restarts {ckpt.writer_restarts}", flush=True)
    print(f"committed {info.step}", flush=True)


if __name__ == "__main__":
    main()
