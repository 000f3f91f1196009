"""Replay's CUDA Adam arithmetics on the CPU, per element: the C pass, its torch twin, and the CPU's own kernel, fused and foreach.

    .venv/bin/python benchmarks/fused_replay_speed.py [--elements 4194304] [--repeats 7] [--threads 1] [--steps 8]

Replay of an AdamW that stepped on a GPU rounds as CUDA's kernels do
(overlapckpt/fused_adam_math.py, overlapckpt/foreach_adam_math.py). The writer computes
that in one pass of C (csrc/cuda_adam.c) where it is built, else through torch operations;
the CPU's own kernel for the same flags (what replay would run with the CPU's roundings) is
the floor. One AdamW step (weight decay 0.01) of one float32 tensor, timed alone; min /
median / p90 / max ns per element over the repeats, and whether the max is within 1.5x of
the median. First, replay's case: ``--steps`` logged steps of one tensor, as the writer steps
a copy group (``cuda_adam_native.steps_deferred``: all of a tensor's steps in one pass over it,
blocks of it carried through every step in cache), against one call a step and the CPU's own
kernel stepped as often; ns per element and step.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from overlapckpt import cuda_adam_native  # noqa: E402
from overlapckpt.adam_step_arguments import AdamGroupTensors, AdamHyperparameters  # noqa: E402
from overlapckpt.foreach_adam_math import step_like_cuda_foreach_adam  # noqa: E402
from overlapckpt.fused_adam_math import step_like_cuda_fused_adam  # noqa: E402


def _spread(seconds: list[float], elements: int) -> str:
    ns = sorted(s / elements * 1e9 for s in seconds)
    median = statistics.median(ns)
    p90 = ns[round(0.9 * (len(ns) - 1))]
    holds = "holds" if ns[-1] <= 1.5 * median else "does not hold"
    return f"{median:.2f} ns per element (min {ns[0]:.2f} / p90 {p90:.2f} / max {ns[-1]:.2f}, n={len(ns)}, 1.5x {holds})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--elements", type=int, default=1 << 22)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=8, help="replay's steps of one tensor, timed first (1: none)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    n = args.elements
    grad = torch.randn(n)

    def emulated(step_like: Callable[..., None]) -> Callable[[], float]:
        def run() -> float:
            param, exp_avg, exp_avg_sq, step = torch.randn(n), torch.zeros(n), torch.zeros(n), torch.zeros(())
            started = time.perf_counter()
            step_like(
                AdamGroupTensors([param], [grad], [exp_avg], [exp_avg_sq], None, [step]),
                AdamHyperparameters(
                    lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8, maximize=False, decoupled_weight_decay=True,
                ),
            )
            return time.perf_counter() - started

        return run

    steps = args.steps
    step_grads = [torch.randn(n) for _ in range(steps)]

    def replayed(step_like: Callable[..., None], deferred: bool) -> Callable[[], float]:
        """``steps`` logged steps of one tensor, as replay steps a copy group: one call a step, or in one blocked pass."""

        def run() -> float:
            param, exp_avg, exp_avg_sq, step = torch.randn(n), torch.zeros(n), torch.zeros(n), torch.zeros(())
            hyperparameters = AdamHyperparameters(
                lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8, maximize=False, decoupled_weight_decay=True,
            )
            started = time.perf_counter()
            with cuda_adam_native.steps_deferred() if deferred else contextlib.nullcontext():
                for g in step_grads:
                    step_like(AdamGroupTensors([param], [g], [exp_avg], [exp_avg_sq], None, [step]), hyperparameters)
            return time.perf_counter() - started

        return run

    def cpu_kernel_steps(**flags: bool) -> Callable[[], float]:
        def run() -> float:
            param = torch.nn.Parameter(torch.randn(n))
            optimizer = torch.optim.AdamW([param], weight_decay=0.01, **flags)
            param.grad = step_grads[0]
            optimizer.step()  # its state made, untimed
            started = time.perf_counter()
            for g in step_grads:
                param.grad = g
                optimizer.step()
            return time.perf_counter() - started

        return run

    def cpu_kernel(**flags: bool) -> Callable[[], float]:
        def run() -> float:
            param = torch.nn.Parameter(torch.randn(n))
            optimizer = torch.optim.AdamW([param], weight_decay=0.01, **flags)
            param.grad = grad
            optimizer.step()  # its state made, untimed
            started = time.perf_counter()
            optimizer.step()
            return time.perf_counter() - started

        return run

    roads: list[tuple[str, str, Callable[[], float]]] = [
        ("fused: the C pass", "1", emulated(step_like_cuda_fused_adam)),
        ("fused: the torch twin", "0", emulated(step_like_cuda_fused_adam)),
        ("fused: the CPU's own fused kernel", "1", cpu_kernel(fused=True)),
        ("foreach: the C pass", "1", emulated(step_like_cuda_foreach_adam)),
        ("foreach: the torch twin", "0", emulated(step_like_cuda_foreach_adam)),
        ("foreach: the CPU's own foreach kernels", "1", cpu_kernel(foreach=True)),
    ]
    replay_roads: list[tuple[str, Callable[[], float]]] = [
        (f"fused: the C pass, {steps} steps in one blocked pass (replay's)", replayed(step_like_cuda_fused_adam, True)),
        (f"fused: the C pass, {steps} steps one call each", replayed(step_like_cuda_fused_adam, False)),
        (f"fused: the CPU's own fused kernel, {steps} steps", cpu_kernel_steps(fused=True)),
        (f"foreach: the C pass, {steps} steps in one blocked pass (replay's)", replayed(step_like_cuda_foreach_adam, True)),
        (f"foreach: the C pass, {steps} steps one call each", replayed(step_like_cuda_foreach_adam, False)),
    ]
    if cuda_adam_native.library() is None:
        raise SystemExit("the C pass is not built here (no C compiler?): run `make install`")
    print(f"{n:,} float32 elements, {args.threads} thread(s), torch {torch.__version__}")
    if steps > 1:
        print(f"replay of {steps} steps, ns per element and step:")
        os.environ["OVERLAPCKPT_NATIVE"] = "1"
        for name, run in replay_roads:
            run()  # warm-up
            print(f"{name}: {_spread([run() for _ in range(args.repeats)], n * steps)}", flush=True)
        print("one step, ns per element:")
    for name, native, run in roads:
        os.environ["OVERLAPCKPT_NATIVE"] = native
        run()  # warm-up
        print(f"{name}: {_spread([run() for _ in range(args.repeats)], n)}", flush=True)


if __name__ == "__main__":
    main()
