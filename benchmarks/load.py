"""Loading a checkpoint as a restarted job meets it: a fresh model and optimizer per load, methods alternated.

    python benchmarks/load.py [--mib 768] [--repeats 9] [--dir DIR] [--torch-threads 1]
                              [--out benchmarks/results/load]

One checkpoint of about ``--mib`` MiB of AdamW state (8 square Linear layers, parameters
and both moments) is written once by overlapckpt at window 1, fsynced. Then, per repeat,
in an order that rotates, each method loads it into a model and optimizer built just
before (the objects a job builds before it resumes, their memory touched by one
training step), the page cache warm:

- ``load(verify=True)`` and ``load(verify=False)``;
- stock ``dcp.load`` through ``get_state_dict`` / ``set_state_dict``.

Each load is timed, and its minor page faults counted (``getrusage``): a load that
faults in fresh memory pays for it in the kernel, and that is what made ``load`` bimodal
(docs/benchmarks.md). Reported: min, median, p90, max of each, and the ratio of the
medians and of the 90th percentiles to stock ``dcp.load`` (the goal: both ≤ 1.0).
Writes ``load.json`` and ``load.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from measure import run_header, write_results
from stats import parse_repeated, spread, spread_text
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MIB = 2**20


def build_model(mib: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """About ``mib`` MiB of AdamW state, every byte touched by one step (a job's objects before it resumes).

    The gradients stay: each later ``opt.step()`` changes every byte of the state (durable.py saves after one).
    """
    width = int((mib * MIB / 4 / 3 / 8) ** 0.5)  # 8 square layers, fp32, parameter + 2 AdamW moments
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(8)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    return model, opt


def _save_once(root: str, mib: int) -> str:
    from overlapckpt import Checkpointer, list_checkpoints

    model, opt = build_model(mib)
    with Checkpointer(model, opt, root, lease=False) as ckpt:
        opt.step()
        ckpt.step()
        ckpt.request()
        ckpt.step()
        ckpt.wait(timeout_s=900)
    return list_checkpoints(root)[-1].path


def _ours(verify: bool) -> Callable[[str, nn.Module, torch.optim.Optimizer], None]:
    def run(path: str, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        from overlapckpt import load

        load(path, model, opt, verify=verify)

    return run


def _stock(path: str, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optimizer": osd}, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)


METHODS: dict[str, Callable[[str, nn.Module, torch.optim.Optimizer], None]] = {
    "load(verify=True)": _ours(True),
    "load(verify=False)": _ours(False),
    "stock dcp.load": _stock,
}


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def measure(path: str, mib: int, repeats: int) -> dict[str, dict[str, list[float]]]:
    """{method: {"s": [...], "minor_faults": [...]}} over ``repeats`` rounds, the order rotating each round."""
    import warnings

    out: dict[str, dict[str, list[float]]] = {name: {"s": [], "minor_faults": []} for name in METHODS}
    names = list(METHODS)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        warnings.filterwarnings("ignore", message=".*torch.distributed is not initialized")
        for name in names:  # one untimed load each: imports, and the page cache holds the shards
            METHODS[name](path, *build_model(mib))
        for round_index in range(repeats):
            order = names[round_index % len(names):] + names[: round_index % len(names)]
            for name in order:
                model, opt = build_model(mib)
                gc.collect()
                faults, started = _minor_faults(), time.perf_counter()
                METHODS[name](path, model, opt)
                out[name]["s"].append(time.perf_counter() - started)
                out[name]["minor_faults"].append(float(_minor_faults() - faults))
                del model, opt
    return out


def report(result: dict[str, Any]) -> str:
    machine, loads = result["machine"], result["loads"]
    stock = spread(loads["stock dcp.load"]["s"])
    lines = [
        f"# Loads with fresh objects ({machine['date_utc']}, {machine['cpu_count']} CPUs, torch {machine['torch']}, "
        f"{result['state_mib']:.0f} MiB of AdamW state, torch threads {result['torch_threads']}, commit {machine.get('commit')})",
        "",
        f"`{result['command']}`",
        "",
        "| load | seconds: median (min / p90 / max) | × stock, median | × stock, p90 | minor faults, median |",
        "|---|---|---|---|---|",
    ]
    for name, figures in loads.items():
        s = spread(figures["s"])
        faults = spread(figures["minor_faults"])["median"]
        lines.append(
            f"| {name} | {spread_text(figures['s'])} | {s['median'] / stock['median']:.2f}× | {s['p90'] / stock['p90']:.2f}× | {faults:,.0f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=768)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--dir", default=None, help="where the checkpoint is written (default: the system's temporary directory)")
    parser.add_argument("--torch-threads", type=int, default=1, help="torch's intra-op threads, as the trainer sets them")
    parser.add_argument("--out", default="benchmarks/results/load")
    args = parse_repeated(parser)
    torch.set_num_threads(args.torch_threads)
    base = tempfile.mkdtemp(dir=args.dir, prefix="load-")
    try:
        path = _save_once(os.path.join(base, "ckpts"), args.mib)
        model, _ = build_model(args.mib)
        state_mib = sum(p.numel() * p.element_size() * 3 for p in model.parameters()) / MIB
        del model
        loads = measure(path, args.mib, args.repeats)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    result = {
        **run_header(),
        "state_mib": state_mib,
        "torch_threads": args.torch_threads,
        "loads": loads,
    }
    write_results(args.out, "load", result, report(result))


if __name__ == "__main__":
    main()
