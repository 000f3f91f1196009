"""Replay throughput: the optimizer's own CPU kernel against one fused pass over W-1 logged steps.

    PYTHONPATH=<dir with numba> python benchmarks/replay_kernel.py [--mib 768] [--window 8] [--threads 1]
                                                                  [--out benchmarks/results/replay]

What replay does in the writer (``writer/replay.py``): for a window of W steps, the
oldest copy group is rolled forward W-1 steps by an optimizer of the training's class
stepping over host tensors, one ``optimizer.step()`` per logged step. Each AdamW step
reads the parameter, gradient and both moments and writes three of them back, in
several passes (one per tensor operation), so W-1 steps cost W-1 times that traffic.

A fused kernel (numba, ``parallel=True``) applies all W-1 steps to each element while
it is in registers: one read of the parameter and moments, the W-1 gradients, one
write. This script times both on the same state and gradients, with the same thread
count, and reports the fused result's largest relative error against the optimizer's
(the figure that GPU-trained replay already accepts, ``tests/gpu_support.replay_tolerance``:
(W-1) x 8 ulp of fp32). Throughput is GB of state (parameters and moments) rolled
forward per replayed step per second.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch
from measure import machine_description

FP32_ULP = 2.0**-23
REPLAY_ULPS_PER_STEP = 8  # as tests/gpu_support.py


def _hyperparameters(window: int) -> list[dict[str, float]]:
    return [{"lr": 1e-3 * (1 - 0.01 * t), "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01} for t in range(window - 1)]


def _torch_replay(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, grads: list[torch.Tensor], hps: list[dict[str, float]], first_step: int, foreach: bool) -> None:
    """What writer/replay.py does: torch.optim.AdamW over the host tensors, one step per logged step."""
    opt = torch.optim.AdamW([p], lr=hps[0]["lr"], betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, foreach=foreach)
    opt.state[p] = {"step": torch.tensor(float(first_step)), "exp_avg": m, "exp_avg_sq": v}
    for g, hp in zip(grads, hps):
        opt.param_groups[0]["lr"] = hp["lr"]
        p.grad = g
        opt.step()
    p.grad = None


def _fused_kernel() -> Any:
    import numba
    import numpy as np

    @numba.njit(parallel=True, cache=False)
    def adamw_window(p, m, v, grads, decay, one_minus_b1, b2, one_minus_b2, step_size, bc2_sqrt, eps):  # pragma: no cover - numba
        n = p.shape[0]
        steps = grads.shape[0]
        for i in numba.prange(n):
            pi, mi, vi = p[i], m[i], v[i]
            for t in range(steps):
                g = grads[t, i]
                pi = pi * decay[t]
                mi = mi + one_minus_b1[t] * (g - mi)  # torch's lerp with weight < 0.5
                vi = vi * b2[t] + one_minus_b2[t] * g * g
                denom = np.sqrt(vi) / bc2_sqrt[t] + eps[t]
                pi = pi - step_size[t] * (mi / denom)
            p[i], m[i], v[i] = pi, mi, vi

    return adamw_window


def _fused_replay(kernel: Any, p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, grads: torch.Tensor, hps: list[dict[str, float]], first_step: int) -> None:
    import numpy as np

    f32 = np.float32
    steps = [first_step + 1 + t for t in range(len(hps))]
    decay = np.array([1 - h["lr"] * h["weight_decay"] for h in hps], dtype=f32)
    omb1 = np.array([1 - h["beta1"] for h in hps], dtype=f32)
    b2 = np.array([h["beta2"] for h in hps], dtype=f32)
    omb2 = np.array([1 - h["beta2"] for h in hps], dtype=f32)
    step_size = np.array([h["lr"] / (1 - h["beta1"] ** s) for h, s in zip(hps, steps)], dtype=f32)
    bc2_sqrt = np.array([(1 - h["beta2"] ** s) ** 0.5 for h, s in zip(hps, steps)], dtype=f32)
    eps = np.array([h["eps"] for h in hps], dtype=f32)
    kernel(p.numpy(), m.numpy(), v.numpy(), grads.numpy(), decay, omb1, b2, omb2, step_size, bc2_sqrt, eps)


def _max_rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref.double()).abs().max() / ref.double().abs().max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=768, help="state: parameters and both moments, fp32")
    parser.add_argument("--window", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="torch's and numba's threads (the writer's default cap is 1 on 2 cores)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/replay")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("NUMBA_NUM_THREADS", str(args.threads))
    n = args.mib * 2**20 // 12
    gen = torch.Generator().manual_seed(0)
    base = [torch.randn(n, generator=gen) * 0.02, torch.randn(n, generator=gen) * 1e-3, torch.rand(n, generator=gen) * 1e-6]
    first_step = 100
    hps = _hyperparameters(args.window)
    grads = torch.randn(len(hps), n, generator=gen) * 1e-3
    state_gb = 3 * n * 4 / 1e9
    times: dict[str, list[float]] = {"AdamW single-tensor (torch's CPU default)": [], "AdamW foreach": []}
    refs = None
    for _ in range(args.repeats):
        for name, foreach in (("AdamW single-tensor (torch's CPU default)", False), ("AdamW foreach", True)):
            p, m, v = (t.clone() for t in base)
            started = time.perf_counter()
            _torch_replay(p, m, v, list(grads), hps, first_step, foreach)
            times[name].append(time.perf_counter() - started)
            refs = (p, m, v)
    result: dict[str, Any] = {
        "machine": machine_description(torch.device("cpu")),
        "state_bytes": 3 * n * 4,
        "window": args.window,
        "threads": args.threads,
        "times_s": times,
    }
    try:
        kernel = _fused_kernel()
    except ImportError as e:
        result["fused"] = f"not run: {e}"
        kernel = None
    if kernel is not None:
        p, m, v = (t.clone() for t in base)
        _fused_replay(kernel, p, m, v, grads[:1].clone(), hps[:1], first_step)  # compiles
        fused = []
        for _ in range(args.repeats):
            p, m, v = (t.clone() for t in base)
            started = time.perf_counter()
            _fused_replay(kernel, p, m, v, grads, hps, first_step)
            fused.append(time.perf_counter() - started)
        times["fused numba kernel"] = fused
        assert refs is not None
        result["fused_max_rel_error"] = {name: _max_rel_error(got, ref) for name, got, ref in zip(("param", "exp_avg", "exp_avg_sq"), (p, m, v), refs)}
        result["fused_bit_equal_share"] = {
            name: float((got == ref).double().mean()) for name, got, ref in zip(("param", "exp_avg", "exp_avg_sq"), (p, m, v), refs)
        }
    tolerance = (args.window - 1) * REPLAY_ULPS_PER_STEP * FP32_ULP
    result["tolerance"] = tolerance
    lines = [
        f"# Replay throughput ({result['machine']['date_utc']}, {result['machine']['cpu_count']} CPUs, torch {result['machine']['torch']}, "
        f"{3 * n * 4 / 2**20:.0f} MiB of AdamW state, W={args.window}: {args.window - 1} replayed steps, {args.threads} thread(s))",
        "",
        "| kernel | replay time, median | GB/s of state per replayed step |",
        "|---|---|---|",
    ]
    for name, ts in times.items():
        med = statistics.median(ts)
        lines.append(f"| {name} | {med:.2f} s | {state_gb * (args.window - 1) / med:.2f} |")
    if "fused_max_rel_error" in result:
        errs = ", ".join(f"{k} {v:.1e}" for k, v in result["fused_max_rel_error"].items())
        equal = ", ".join(f"{k} {v:.0%}" for k, v in result["fused_bit_equal_share"].items())
        best_torch = min(statistics.median(t) for k, t in times.items() if k.startswith("AdamW"))
        speedup = best_torch / statistics.median(times["fused numba kernel"])
        result["fused_speedup"] = speedup
        lines += [
            "",
            f"Fused kernel against torch's AdamW: {speedup:.1f}× faster; largest relative error {errs} "
            f"(tolerance of GPU-trained replay {tolerance:.1e}); bit-equal elements {equal}.",
        ]
    else:
        lines += ["", f"Fused kernel: {result['fused']}"]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "replay.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(args.out, "replay.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))  # noqa: T201 - a benchmark's report


if __name__ == "__main__":
    main()
