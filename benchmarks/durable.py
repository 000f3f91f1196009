"""Time to durable, writer memory and load time: overlapckpt against dcp.async_save PROCESS and stock dcp.load.

    python benchmarks/durable.py [--mib 768] [--repeats 3] [--dir DIR] [--out benchmarks/results/durable]

One process holds AdamW state of about ``--mib`` MiB (8 linear layers, parameters
and both moments). Alternated per repeat, on the same directory with fsync on:

- overlapckpt, window 1: ``request()`` to the commit (``wait``);
- ``dcp.async_save(..., async_checkpointer_type=PROCESS)``: the call to its future's result;
- the raw figure: one file of the same bytes written and fsynced.

Then loads of the same checkpoint with a warm page cache: ``load(verify=True)``,
``load(verify=False)`` and stock ``dcp.load``. It reports the writer's peak RSS
(``VmHWM`` of the writer process) and the share of the raw write's bandwidth.
Writes ``durable.json`` and ``durable.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import torch
from harness import init_single_rank_group
from measure import machine_description
from torch import nn


def _model(mib: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    width = int((mib * 2**20 / 4 / 3 / 8) ** 0.5)  # 8 square layers, fp32, parameter + 2 AdamW moments
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(8)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(2, width)).sum().backward()
    opt.step()  # the moments exist
    return model, opt


def _vm_hwm_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _overlapckpt_s(model, opt, root: str) -> tuple[float, float]:
    from overlapckpt import Checkpointer

    with Checkpointer(model, opt, root, lease=False) as ckpt:
        started = time.perf_counter()
        ckpt.request()
        ckpt.step()
        ckpt.wait(timeout_s=600)
        seconds = time.perf_counter() - started
        rss = _vm_hwm_mib(ckpt.writer_pid)
    return seconds, rss


def _async_save_s(model, opt, path: str) -> float:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    kind = getattr(dcp, "AsyncCheckpointerType", None)
    if kind is None:
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType as kind  # type: ignore[no-redef]
    msd, osd = get_state_dict(model, opt)
    started = time.perf_counter()
    future = dcp.async_save({"model": msd, "optimizer": osd}, checkpoint_id=path, async_checkpointer_type=kind.PROCESS)
    future.result()
    return time.perf_counter() - started


def _raw_write_s(nbytes: int, path: str) -> float:
    data = torch.empty(nbytes, dtype=torch.uint8).numpy()
    started = time.perf_counter()
    with open(path, "wb") as f:
        f.write(memoryview(data))
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mib", type=int, default=768)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where checkpoints are written (default: a temporary directory)")
    parser.add_argument("--out", default="benchmarks/results/durable")
    args = parser.parse_args()
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from overlapckpt import list_checkpoints, load

    init_single_rank_group()  # DCP's PROCESS checkpointer needs one even for one rank; overlapckpt then sees one rank
    model, opt = _model(args.mib)
    nbytes = sum(p.numel() * 4 * 3 for p in model.parameters())
    base = tempfile.mkdtemp(dir=args.dir, prefix="durable-")
    times: dict[str, list[float]] = {"overlapckpt window=1": [], "dcp.async_save PROCESS": [], "raw write": []}
    writer_rss: list[float] = []
    try:
        for i in range(args.repeats):
            seconds, rss = _overlapckpt_s(model, opt, os.path.join(base, f"ours-{i}"))
            times["overlapckpt window=1"].append(seconds)
            writer_rss.append(rss)
            times["dcp.async_save PROCESS"].append(_async_save_s(model, opt, os.path.join(base, f"dcp-{i}")))
            times["raw write"].append(_raw_write_s(nbytes, os.path.join(base, f"raw-{i}")))
        ours = list_checkpoints(os.path.join(base, "ours-0"))[-1].path
        loads: dict[str, list[float]] = {"load(verify=True)": [], "load(verify=False)": [], "stock dcp.load": []}
        for _ in range(args.repeats):
            for verify in (True, False):
                fresh, fresh_opt = _model(args.mib)
                started = time.perf_counter()
                load(ours, fresh, fresh_opt, verify=verify)
                loads[f"load(verify={verify})"].append(time.perf_counter() - started)
            fresh, fresh_opt = _model(args.mib)
            started = time.perf_counter()
            msd, osd = get_state_dict(fresh, fresh_opt)
            dcp.load({"model": msd, "optimizer": osd}, checkpoint_id=ours)
            set_state_dict(fresh, fresh_opt, model_state_dict=msd, optim_state_dict=osd)
            loads["stock dcp.load"].append(time.perf_counter() - started)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    raw = statistics.median(times["raw write"])
    machine = machine_description(torch.device("cpu"))
    result = {"machine": machine, "state_bytes": nbytes, "times_s": times, "loads_s": loads, "writer_peak_rss_mib": writer_rss}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "durable.json"), "w") as f:
        json.dump(result, f, indent=1)
    lines = [
        f"# Time to durable ({machine['date_utc']}, {machine['cpu_count']} CPUs, torch {machine['torch']}, {nbytes / 2**20:.0f} MiB of AdamW state)",
        "",
        "| method | request→durable, median (min–max) | share of raw bandwidth |",
        "|---|---|---|",
    ]
    for name, ts in times.items():
        lines.append(f"| {name} | {statistics.median(ts):.2f} s ({min(ts):.2f}–{max(ts):.2f}) | {raw / statistics.median(ts):.0%} |")
    lines += ["", f"overlapckpt writer peak RSS: {statistics.median(writer_rss):.0f} MiB ({statistics.median(writer_rss) * 2**20 / nbytes:.2f}× the state)", ""]
    lines += ["| load (page cache warm) | median (min–max) |", "|---|---|"]
    for name, ts in loads.items():
        lines.append(f"| {name} | {statistics.median(ts):.2f} s ({min(ts):.2f}–{max(ts):.2f}) |")
    with open(os.path.join(args.out, "durable.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))  # noqa: T201 - a benchmark's report


if __name__ == "__main__":
    main()
