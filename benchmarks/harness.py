"""Run one training workload several ways, one after another, and report what checkpointing costs.

    python benchmarks/harness.py --size tiny --out benchmarks/results/cpu
    python benchmarks/harness.py --size h200 --device cuda --out results/h200
    python benchmarks/harness.py --nproc 2 --size tiny --out benchmarks/results/cpu-2rank   (see dist_bench.py)

Every method trains the same model on the same token stream (training simply goes
on from one method to the next), with a warm-up that takes one checkpoint, so the
one-time costs (buffer allocation, pinning, process start) are reported apart from
the steady state. Writes ``results.json``, ``results.md`` and ``timeline.png``
(when matplotlib is there) under ``--out``. It reports; it does not pass or fail.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
# The benchmark's own modules, and the source checkout's overlapckpt when it is not installed.
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]

from measure import HostMemory, StepTimer, machine_description, pinned_copy_peak_bytes_per_s  # noqa: E402
from methods import CheckpointRecord, Method, all_methods, torch_checkpointing_unavailable  # noqa: E402
from report import markdown_table, plot_timeline, summarize_method, targets  # noqa: E402
from stats import MIN_REPEATS  # noqa: E402
from workload import SIZES, Workload  # noqa: E402

# Checkpoints per method and phase: the spread of each figure needs at least 7 (stats.py).
DEFAULT_CHECKPOINTS = MIN_REPEATS
FIRST_CHECKPOINT_STEP = 2  # timed steps before the first request, so its steps stand against a settled loop


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_single_rank_group() -> None:
    """DCP's PROCESS checkpointer needs a process group, even for one rank."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)


def _record_json(rec: CheckpointRecord, phase: str) -> dict[str, Any]:
    out = {
        "step": rec.step,
        "phase": phase,
        "blocking_s": rec.blocking_s,
        "request_to_commit_s": rec.request_to_commit_s,
        "nbytes": rec.nbytes,
        **rec.extra,
    }
    copied, copy_s = rec.extra.get("copied_nbytes"), rec.extra.get("copy_s")
    out["d2h_bytes_per_s"] = copied / copy_s if copied and copy_s else None
    return out


def run_method(method: Method, workload: Workload, plan: dict[str, int], root: str, timeout_s: float) -> dict[str, Any]:
    """Three phases on one method, the same for every method (the baseline takes no checkpoint):

    * warm-up: one checkpoint, waited for: allocation, pinning and process starts are not timed;
    * stall: each checkpoint alone: ``quiet_steps`` timed steps without one (this method's
      own reference, which corrects for the machine drifting between methods), then the
      request and ``every`` timed steps from it, then its commit waited for untimed, so
      every checkpoint's copy is measured against an idle writer;
    * throughput: a checkpoint every ``every`` steps without waiting, as a training run
      does; the steps per second it reaches against the baseline's.
    """
    cuda = workload.device.type == "cuda"
    every = plan["every"]
    baseline = method.name == "baseline"
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    memory = HostMemory()
    memory.begin()
    method.start(workload, os.path.join(root, method.name))
    phases: list[str] = []

    def iteration(save: bool, phase: str) -> None:
        workload.forward_backward()
        method.before_optimizer_step()
        workload.optimizer_step()
        method.after_optimizer_step()
        if save and not baseline:
            method.save(workload.iteration)
            phases.append(phase)
        method.end_of_iteration()

    def synchronize() -> None:
        if cuda:
            torch.cuda.synchronize()

    for i in range(plan["warmup"]):
        iteration(i == 0, "warmup")
    method.drain(timeout_s)

    timer = StepTimer(workload.device)
    checkpoint_steps: list[int] = []
    quiet_steps: list[int] = []
    synchronize()
    timer.mark()
    for k in range(plan["stall_checkpoints"]):
        if k:
            with timer.untimed():  # the previous checkpoint commits here
                method.drain(timeout_s)
                synchronize()
        for j in range(plan["quiet_steps"] + every):
            index = k * (plan["quiet_steps"] + every) + j
            request = j == plan["quiet_steps"]
            (checkpoint_steps if request else quiet_steps if j < plan["quiet_steps"] else []).append(index)
            iteration(request, "stall")
            timer.mark()
            with timer.untimed():
                memory.sample_children()
    step_times = timer.step_times_s()  # synchronizes with the device on GPU
    method.drain(timeout_s)

    throughput_steps = FIRST_CHECKPOINT_STEP + plan["throughput_checkpoints"] * every
    synchronize()
    started = time.perf_counter()
    for i in range(throughput_steps):
        iteration(i >= FIRST_CHECKPOINT_STEP and (i - FIRST_CHECKPOINT_STEP) % every == 0, "throughput")
        memory.sample_children()
    synchronize()
    throughput_wall_s = time.perf_counter() - started

    method.finish(timeout_s)
    memory.sample_children()
    result = {
        "label": method.label,
        "step_times_s": step_times,
        "checkpoint_steps": checkpoint_steps,
        "quiet_steps": quiet_steps,
        "throughput": {"steps": throughput_steps, "wall_s": throughput_wall_s, "every": every},
        "records": [_record_json(r, phase) for r, phase in zip(method.records, phases)],
        "notes": method.notes,
        "memory": {
            "rss_peak_extra_bytes": memory.peak_extra_bytes(),
            "rss_peak_reset": memory.can_reset_peak,
            "children_rss_peak_bytes": memory.children_peak_bytes,
            "host_pinned_bytes": method.notes.get("host_pinned_bytes"),
            "device_peak_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        },
    }
    method.close()
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto (cuda when there is one)")
    parser.add_argument("--methods", default="all", help="comma-separated method names (see --list), or all")
    parser.add_argument("--windows", default="2,4,8", help="overlapckpt windows besides 1, in each consistency mode")
    parser.add_argument("--every", type=int, default=10, help="steps between checkpoints (K)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per method, one of them checkpointed")
    parser.add_argument("--quiet-steps", type=int, default=3, help="timed steps without a checkpoint before each one")
    parser.add_argument("--train-threads", type=int, default=None, help="CPU: torch threads for training (default: cores - 1, a core for background work)")
    parser.add_argument("--out", help="directory for results.json, results.md and timeline.png (required)")
    parser.add_argument("--checkpoint-dir", default=None, help="where checkpoints are written (default: a temp dir)")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="longest wait for one method's commits")
    parser.add_argument("--checkpoints", type=int, default=DEFAULT_CHECKPOINTS, help="checkpoints per method in the stall phase")
    parser.add_argument("--throughput-checkpoints", type=int, default=DEFAULT_CHECKPOINTS, help="checkpoints per method in the throughput phase")
    parser.add_argument("--budget-s", type=float, default=None, help="skip methods that would end past this many seconds")
    parser.add_argument("--list", action="store_true", help="print the method names and exit")
    parser.add_argument("--nproc", type=int, default=1, help="ranks (CPU, gloo): above 1, benchmarks/dist_bench.py runs DDP and FSDP2")
    parser.add_argument("--parallelism", default="ddp,fsdp2", help="with --nproc > 1: ddp, fsdp2, or both (comma-separated)")
    args = parser.parse_args(argv)
    if args.nproc > 1:
        if args.list or not args.out:
            from dist_bench import dist_methods

            if args.list:
                print("\n".join(m.name for m in dist_methods()))
                return {}
            parser.error("--out is required: the directory for results.json and results.md")
        from dist_bench import run_distributed

        return run_distributed(args)

    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else ("cpu" if args.device == "auto" else args.device))
    cuda = device.type == "cuda"
    windows = tuple(int(w) for w in args.windows.split(",") if w)
    methods = all_methods(cuda, windows)
    if args.list:
        print("\n".join(m.name for m in methods))
        return {}
    if not args.out:
        parser.error("--out is required: the directory for results.json, results.md and timeline.png")
    if args.methods != "all":
        wanted = ["baseline"] + [n for n in args.methods.split(",") if n and n != "baseline"]
        # A peer that cannot run here (torch_checkpointing not carried to the device) is named and
        # left out: the headline goes on with the others.
        missing_peer = torch_checkpointing_unavailable()
        if "torch_checkpointing_async" in wanted and missing_peer is not None:
            print(f"  torch_checkpointing_async       not run: {missing_peer}", flush=True)
            wanted.remove("torch_checkpointing_async")
        known = {m.name: m for m in methods}
        unknown = [n for n in wanted if n not in known]
        if unknown:
            parser.error(f"unknown method(s) {unknown}; choose from {sorted(known)}")
        methods = [known[n] for n in wanted]
    plan = {
        "every": args.every,
        "warmup": args.warmup,
        "stall_checkpoints": args.checkpoints,
        "quiet_steps": args.quiet_steps,
        "throughput_checkpoints": args.throughput_checkpoints,
    }
    if any(m.name.startswith("dcp_async_process") for m in methods):
        init_single_rank_group()

    if not cuda:
        # Background work (DCP's thread or process, overlapckpt's writer) needs a core; on a
        # GPU node it has many. Without one, every method measures CPU contention instead.
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        torch.set_num_threads(args.train_threads or max(1, cores - 1))
    plan["train_threads"] = torch.get_num_threads()
    os.makedirs(args.out, exist_ok=True)
    run_started = time.perf_counter()
    workload = Workload(args.size, device)
    for _ in range(2):  # creates the optimizer state, so every method checkpoints the same bytes
        workload.forward_backward()
        workload.optimizer_step()
    state_nbytes = workload.state_nbytes()
    print(f"{args.size}: {workload.parameter_count() / 1e6:.1f} M parameters, {state_nbytes / 2**20:.1f} MiB of state on {device}", flush=True)
    copy_peak = pinned_copy_peak_bytes_per_s(device, min(state_nbytes, 2 << 30))

    root = args.checkpoint_dir or tempfile.mkdtemp(prefix="overlapckpt-bench-")
    result: dict[str, Any] = {
        "machine": machine_description(device),
        "workload": workload.describe(),
        "state_nbytes": state_nbytes,
        "plan": plan,
        "copy_peak": copy_peak,
        "checkpoint_dir": root,
        "methods": {},
        "skipped": [],
        "failed": {},
    }
    longest_s = 0.0
    for method in methods:
        elapsed_s = time.perf_counter() - run_started
        if args.budget_s is not None and method.name != "baseline" and elapsed_s + longest_s > args.budget_s:
            result["skipped"].append(method.name)
            print(f"  {method.name:<28} skipped: {elapsed_s:.0f} s spent of --budget-s {args.budget_s:.0f}", flush=True)
            continue
        started = time.perf_counter()
        try:
            result["methods"][method.name] = run_method(method, workload, plan, root, args.timeout_s)
        except Exception as e:  # one method's failure is a figure too; the others still run
            if method.name == "baseline":
                raise
            result["failed"][method.name] = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}"
            print(f"  {method.name:<28} FAILED: {type(e).__name__}: {e}", flush=True)
            try:
                method.close()
            except Exception:
                pass
            continue
        took_s = time.perf_counter() - started
        longest_s = max(longest_s, took_s)
        print(f"  {method.name:<28} {took_s:6.1f} s", flush=True)
        # Written after every method, so a run cut short still leaves its figures.
        table = _write_outputs(result, args.out, args.every, cuda)
    print(table)
    if not os.path.exists(os.path.join(args.out, "timeline.png")):
        print("matplotlib is not installed: no timeline.png (pip install 'overlapckpt[bench]')")
    return result


def _write_outputs(result: dict[str, Any], out: str, every: int, cuda: bool) -> str:
    runs = result["methods"]
    base = runs["baseline"]
    base_median = statistics.median(base["step_times_s"])
    for run in runs.values():
        run["metrics"] = summarize_method(run, base, every, result["copy_peak"]["bytes_per_s"])
    result["baseline_median_step_s"] = base_median
    result["targets"] = targets(runs, cuda)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(result, f, indent=1)
    table = markdown_table(result)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(table)
    plot_timeline(result, os.path.join(out, "timeline.png"))
    return table


if __name__ == "__main__":
    main()
