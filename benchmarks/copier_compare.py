"""Whether the copier over the plain CPU device (copies on a worker thread) beats copying in the hook, on the CPU.

    python benchmarks/copier_compare.py [--width 2048] [--steps 40] [--every 5]

Trains the tests' small model with window=1 checkpoints every few steps, once with the
default ``CpuCopier`` (the copy runs inside the post-hook) and once with
``StreamCopier`` over ``CpuDevice`` (the CPU default: the copy runs on the side
stream's worker thread while the next forward and
backward run; the next optimizer step waits for it). Prints the median step time,
the host time spent in overlapckpt's hooks per checkpoint and the total time, per
copier, best of a few alternating rounds. It reports; it does not pass or fail.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(os.path.dirname(_HERE), "tests"), os.path.dirname(_HERE)]

import torch  # noqa: E402

from overlapckpt.seams import Checkpointer  # noqa: E402
from overlapckpt.train.copying.cpu_copier import CpuCopier  # noqa: E402
from overlapckpt.train.copying.cpu_device import CpuDevice  # noqa: E402
from overlapckpt.train.copying.stream_copier import StreamCopier  # noqa: E402

from helpers import make_run, train_step  # noqa: E402


def _stream_copier() -> StreamCopier:
    return StreamCopier(CpuDevice())


COPIERS = {"CpuCopier": CpuCopier, "StreamCopier": _stream_copier}


def run(make_copier, width: int, steps: int, every: int) -> dict[str, float]:
    model, opt, sched, sampler = make_run(width=width)
    step_s = []
    with tempfile.TemporaryDirectory() as root, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ckpt = Checkpointer(model, opt, root, window=1, every=every, keep=1, max_inflight=2, copier=make_copier())
        started = time.perf_counter()
        for _ in range(steps):
            t0 = time.perf_counter()
            train_step(model, opt, sched, sampler)
            ckpt.step()
            step_s.append(time.perf_counter() - t0)
        loop_s = time.perf_counter() - started
        ckpt.close(timeout_s=120)
        hooks = [s["hook_host_s"] for s in ckpt.stats]
    return {
        "median_step_ms": 1e3 * statistics.median(step_s),
        "hook_ms_per_checkpoint": 1e3 * statistics.median(hooks) if hooks else float("nan"),
        "loop_s": loop_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)  # training on one core, the copy worker on the other, as in make bench
    best: dict[str, dict[str, float]] = {}
    for _ in range(args.rounds):
        for name, make_copier in COPIERS.items():
            r = run(make_copier, args.width, args.steps, args.every)
            if name not in best or r["loop_s"] < best[name]["loop_s"]:
                best[name] = r
    state_mb = 3 * sum(p.numel() * 4 for p in make_run(width=args.width)[0].parameters()) / 2**20
    print(f"width {args.width} ({state_mb:.1f} MiB of AdamW state), {args.steps} steps, a checkpoint every {args.every}")
    for name, r in best.items():
        print(f"{name:16} median step {r['median_step_ms']:7.2f} ms  hooks {r['hook_ms_per_checkpoint']:7.2f} ms/ckpt  loop {r['loop_s']:6.2f} s")


if __name__ == "__main__":
    main()
