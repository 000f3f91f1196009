"""The node-local tier's figures: restore time by source, and the steady-state step overhead of its cadence.

    python benchmarks/tiers.py [--mib 256] [--repeats 7] [--root-dir DIR] [--local-dir DIR]
                               [--steps 40] [--out benchmarks/results/tiers]

**Restore.** One checkpoint of about ``--mib`` MiB of AdamW state is committed by one
Checkpointer into both tiers (``local_every``): the root under ``--root-dir`` (a disk)
and the local tier under ``--local-dir`` (``/dev/shm`` by default). Then, per repeat,
in an order that rotates, into a model and optimizer built just before:

- ``load(root, local_dir=...)``: the local tier's checkpoint, verified (what a restart picks);
- ``load(root)``: the root's, verified;
- stock ``dcp.load`` of the root's checkpoint, unverified.

With ``--drop-caches`` (root only) the page cache is dropped before each load, so the
root's loads read the disk, as a job on a new node does; tmpfs is memory either way.
The restore from a partner's replica needs two nodes: ``benchmarks/tiers_nodes.py``.

**Step overhead.** The same loop (``--steps`` AdamW steps on a model of ``--train-mib``
MiB of state, training on one thread) per repeat, configurations rotating:
no checkpointing; the root alone every 10 steps; the local tier alone every 10 steps
(``local_every=10``, the root at ``every=None``). Reported: the median step time of each
repeat, and its spread over the repeats.

Writes ``tiers.json`` and ``tiers.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from load import build_model
from measure import run_header, write_results
from stats import MIN_REPEATS, parse_repeated, spread, spread_text
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MIB = 2**20
CADENCE_STEPS = 10


def commit_both_tiers(root: str, local: str, mib: int) -> tuple[str, str]:
    """One checkpoint in both tiers, from one snapshot; (root's checkpoint directory, local tier's)."""
    from overlapckpt import Checkpointer, list_checkpoints

    model, opt = build_model(mib)
    with Checkpointer(model, opt, root, lease=False, local_every=1000, local_dir=local) as ckpt:
        opt.step()
        ckpt.step()
        ckpt.request()  # a request() goes to both tiers
        ckpt.step()
        ckpt.wait(timeout_s=900)
    return list_checkpoints(root)[-1].path, list_checkpoints(local)[-1].path


def _drop_caches() -> bool:
    """Drop the page cache (needs root); whether it could."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def _stock(path: str, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optimizer": osd}, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)


def measure_restores(root: str, local: str, root_checkpoint: str, mib: int, repeats: int, drop: bool) -> dict[str, list[float]]:
    from overlapckpt import load

    methods: dict[str, Callable[[nn.Module, torch.optim.Optimizer], Any]] = {
        "local tier: load(root, local_dir=...)": lambda m, o: load(root, m, o, local_dir=local),
        "root: load(root)": lambda m, o: load(root, m, o),
        "root: stock dcp.load": lambda m, o: _stock(root_checkpoint, m, o),
    }
    out: dict[str, list[float]] = {name: [] for name in methods}
    names = list(methods)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        warnings.filterwarnings("ignore", message=".*torch.distributed is not initialized")
        for name in names:  # untimed: imports, first mappings
            methods[name](*build_model(mib))
        for index in range(repeats):
            for name in names[index % len(names):] + names[: index % len(names)]:
                model, opt = build_model(mib)
                gc.collect()
                if drop:
                    _drop_caches()
                started = time.perf_counter()
                info = methods[name](model, opt)
                out[name].append(time.perf_counter() - started)
                if info is not None and name.startswith("local") and not info.path.startswith(local):
                    raise RuntimeError(f"the local-tier load read {info.path}, not the local tier {local}")
                del model, opt
    return out


def _train_loop(steps: int, mib: int, settings: dict[str, Any] | None, base: str) -> tuple[list[float], int]:
    """Step times (forward, backward, optimizer step, ckpt.step) of one loop, and the checkpoints it committed."""
    from overlapckpt import Checkpointer

    model, opt = build_model(mib)
    width = model[0].in_features
    x = torch.randn(4, width)
    ckpt = None
    if settings is not None:
        shutil.rmtree(base, ignore_errors=True)
        ckpt = Checkpointer(model, opt, os.path.join(base, "root"), lease=False, **settings)
    times = []
    committed = 0
    try:
        for _ in range(steps):
            started = time.perf_counter()
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if ckpt is not None:
                ckpt.step()
            times.append(time.perf_counter() - started)
    finally:
        if ckpt is not None:
            ckpt.close()
            committed = len(ckpt.stats)
    return times, committed


def measure_overhead(
    steps: int, mib: int, repeats: int, root_dir: str | None, local_parent: str
) -> tuple[dict[str, list[float]], dict[str, list[int]]]:
    configs: dict[str, dict[str, Any] | None] = {
        "no checkpointing": None,
        f"root alone, every={CADENCE_STEPS}": {"every": CADENCE_STEPS, "keep": 2},
        f"local tier alone, local_every={CADENCE_STEPS}": {"local_every": CADENCE_STEPS, "local_keep": 2},
    }
    out: dict[str, list[float]] = {name: [] for name in configs}
    commits: dict[str, list[int]] = {name: [] for name in configs}
    names = list(configs)
    base = tempfile.mkdtemp(dir=root_dir, prefix="tiers-loop-")
    local = tempfile.mkdtemp(dir=local_parent, prefix="overlapckpt-bench-loop-")
    try:
        for index in range(repeats):
            for name in names[index % len(names):] + names[: index % len(names)]:
                settings = configs[name]
                if settings is not None and "local_every" in settings:
                    shutil.rmtree(local, ignore_errors=True)
                    settings = {**settings, "local_dir": local}
                times, committed = _train_loop(steps, mib, settings, base)
                out[name].append(statistics.median(times[CADENCE_STEPS:]))  # past the first checkpoint's start-up
                commits[name].append(committed)
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(local, ignore_errors=True)
    return out, commits


def report(result: dict[str, Any]) -> str:
    machine = result["machine"]
    lines = [
        f"# The local tier ({machine['date_utc']}, {machine['cpu_count']} CPUs, torch {machine['torch']}, commit {machine.get('commit')})",
        "",
        f"`{result['command']}`",
        "",
        f"## Restore, {result['state_mib']:.0f} MiB of AdamW state, fresh objects per load"
        f" ({'page cache dropped before each load' if result['dropped_caches'] else 'page cache warm'};"
        f" root on {result['root_fs']}, local tier on {result['local_fs']})",
        "",
        "| source | seconds: median (min / p90 / max) | × stock dcp.load from the root, median |",
        "|---|---|---|",
    ]
    stock = spread(result["restore_s"]["root: stock dcp.load"])["median"]
    for name, values in result["restore_s"].items():
        lines.append(f"| {name} | {spread_text(values)} | {spread(values)['median'] / stock:.2f}× |")
    lines.append("| a partner's replica | on two nodes: benchmarks/tiers_nodes.py | – |")
    lines += [
        "",
        f"## Step time, {result['train_mib']:.0f} MiB of AdamW state, {result['steps']} steps per repeat, median step of each repeat",
        "",
        "| configuration | median step ms: median of repeats (min / p90 / max) | × no checkpointing | checkpoints committed per repeat (of "
        f"{result['steps'] // CADENCE_STEPS} asked), median |",
        "|---|---|---|---|",
    ]
    none = spread(result["step_s"]["no checkpointing"])["median"]
    for name, values in result["step_s"].items():
        count = statistics.median(result["checkpoints_committed"][name])
        lines.append(f"| {name} | {spread_text(values, 'ms', 1000.0, 1)} | {spread(values)['median'] / none:.3f}× | {count:g} |")
    return "\n".join(lines) + "\n"


def _filesystem(path: str) -> str:
    try:
        out = subprocess.run(["df", "--output=fstype", path], capture_output=True, text=True, timeout=10).stdout.split()
        return out[-1] if out else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=256, help="state per rank for the restore figures")
    parser.add_argument("--train-mib", type=int, default=64, help="state for the step-overhead loop")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=MIN_REPEATS)
    parser.add_argument("--root-dir", default=None, help="where the root goes (default: the temporary directory)")
    parser.add_argument("--local-dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None, help="where the local tier goes")
    parser.add_argument("--drop-caches", action="store_true", help="drop the page cache before each load (needs root)")
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/results/tiers")
    args = parse_repeated(parser)
    torch.set_num_threads(args.torch_threads)
    base = tempfile.mkdtemp(dir=args.root_dir, prefix="tiers-")
    local = tempfile.mkdtemp(dir=args.local_dir, prefix="overlapckpt-bench-")
    try:
        root = os.path.join(base, "root")
        root_checkpoint, _ = commit_both_tiers(root, local, args.mib)
        dropped = args.drop_caches and _drop_caches()
        restore_s = measure_restores(root, local, root_checkpoint, args.mib, args.repeats, dropped)
        root_fs, local_fs = _filesystem(base), _filesystem(local)
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(local, ignore_errors=True)
    step_s, commits = measure_overhead(args.steps, args.train_mib, args.repeats, args.root_dir, args.local_dir or tempfile.gettempdir())
    model, _ = build_model(args.mib)
    state_mib = sum(p.numel() * p.element_size() * 3 for p in model.parameters()) / MIB
    model, _ = build_model(args.train_mib)
    train_mib = sum(p.numel() * p.element_size() * 3 for p in model.parameters()) / MIB
    result = {
        **run_header(),
        "state_mib": state_mib,
        "train_mib": train_mib,
        "steps": args.steps,
        "dropped_caches": dropped,
        "root_fs": root_fs,
        "local_fs": local_fs,
        "restore_s": restore_s,
        "step_s": step_s,
        "checkpoints_committed": commits,
    }
    write_results(args.out, "tiers", result, report(result))


if __name__ == "__main__":
    main()
