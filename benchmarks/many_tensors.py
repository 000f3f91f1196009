"""Time to durable for a state of many small tensors: overlapckpt with and without its tensor templates, and stock dcp.save.

    python benchmarks/many_tensors.py [--tensors 30000] [--repeats 7] [--dir DIR] [--out benchmarks/results/many-tensors]

The state is ``--tensors`` small fp32 tensors: a third parameters of 4 x 4, with AdamW's
two moments each (a model of many small layers: norms, biases, experts' small pieces).
Here DCP's per-item ``torch.save`` costs more than the bytes: 30,000 items of 64 bytes.
Methods, alternated per repeat, each on its own copy of the same state, on one local
directory, fsync on:

- overlapckpt, window 1, ``request()`` to the commit, one ``Checkpointer`` kept open;
- the same with ``OVERLAPCKPT_TENSOR_TEMPLATES=0`` in its writer's environment: every
  blob by ``torch.save`` (the code before ``format/tensor_blob.py``);
- stock ``dcp.save`` of the same state (``get_state_dict``), synchronous.

Between two checkpoints an optimizer step changes every tensor. The first checkpoint of
each method is reported apart (cold). Reported: min / median / p90 / max of the others
(``stats.py``), and where the writer's time went (``persist_phases_s``). Then loads of
overlapckpt's newest checkpoint into fresh objects, alternated: ``load()`` (verified),
``load(verify=False)`` and stock ``dcp.load``.
Writes ``many_tensors.json`` and ``many_tensors.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
import warnings
from typing import Any

import torch
from load import METHODS as LOAD_METHODS
from measure import machine_description, write_results
from stats import MIN_REPEATS, parse_repeated, spread, spread_text
from torch import nn


def _model(tensors: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.ParameterList([nn.Parameter(torch.randn(4, 4)) for _ in range(tensors // 3)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    for p in model.parameters():
        p.grad = torch.randn_like(p)  # kept: each later step changes every parameter and moment
    opt.step()
    return model, opt


class _Overlapckpt:
    def __init__(self, tensors: int, root: str, templates: bool) -> None:
        from overlapckpt import Checkpointer

        self.model, self.opt = _model(tensors)
        before = os.environ.get("OVERLAPCKPT_TENSOR_TEMPLATES")
        os.environ["OVERLAPCKPT_TENSOR_TEMPLATES"] = "1" if templates else "0"  # read by the writer at its start
        try:
            self.ckpt = Checkpointer(self.model, self.opt, root, lease=False, keep=2)
        finally:
            if before is None:
                del os.environ["OVERLAPCKPT_TENSOR_TEMPLATES"]
            else:
                os.environ["OVERLAPCKPT_TENSOR_TEMPLATES"] = before
        self.phases: list[dict[str, float]] = []
        self.cold_s = self.save_s()

    def save_s(self) -> float:
        self.opt.step()
        self.ckpt.step()
        started = time.perf_counter()
        self.ckpt.request()
        self.ckpt.step()
        self.ckpt.wait(timeout_s=900)
        elapsed = time.perf_counter() - started
        self.phases.append(dict(self.ckpt.stats[-1]["persist_phases_s"]))
        return elapsed

    def close(self) -> None:
        self.ckpt.close()


class _DcpSave:
    def __init__(self, tensors: int, root: str) -> None:
        self.model, self.opt = _model(tensors)
        self.root = root
        self.count = 0
        self.cold_s = self.save_s()

    def save_s(self) -> float:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        self.opt.step()
        path = os.path.join(self.root, f"step-{self.count}")
        self.count += 1
        started = time.perf_counter()
        msd, osd = get_state_dict(self.model, self.opt)
        with warnings.catch_warnings():  # one process, as overlapckpt's writer saves: no group, deliberately
            warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process")
            dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=path, no_dist=True)
        elapsed = time.perf_counter() - started
        if self.count > 2:
            shutil.rmtree(os.path.join(self.root, f"step-{self.count - 3}"), ignore_errors=True)
        return elapsed

    def close(self) -> None:
        pass


METHODS = ("overlapckpt", "overlapckpt, templates off", "dcp.save")


# The loads benchmarks/load.py times, under this report's names.
LOADS = {
    "overlapckpt load()": LOAD_METHODS["load(verify=True)"],
    "overlapckpt load(verify=False)": LOAD_METHODS["load(verify=False)"],
    "stock dcp.load": LOAD_METHODS["stock dcp.load"],
}


def _load_s(name: str, path: str, tensors: int) -> float:
    model, opt = _model(tensors)  # fresh objects, built before the clock starts
    started = time.perf_counter()
    LOADS[name](path, model, opt)
    return time.perf_counter() - started


def _loads(tensors: int, repeats: int, root: str) -> dict[str, Any]:
    """Each load method into fresh objects, alternated, from overlapckpt's newest checkpoint (page cache warm)."""
    from overlapckpt import list_checkpoints

    path = list_checkpoints(root)[-1].path
    times: dict[str, list[float]] = {name: [] for name in LOADS}
    for _ in range(repeats):
        for name in LOADS:
            times[name].append(_load_s(name, path, tensors))
    return {name: {"s": times[name], "spread": spread(times[name])} for name in LOADS}


def run(tensors: int, repeats: int, base: str) -> dict[str, Any]:
    methods: dict[str, Any] = {
        "overlapckpt": _Overlapckpt(tensors, os.path.join(base, "ours"), templates=True),
        "overlapckpt, templates off": _Overlapckpt(tensors, os.path.join(base, "ours-off"), templates=False),
        "dcp.save": _DcpSave(tensors, os.path.join(base, "dcp")),
    }
    times: dict[str, list[float]] = {name: [] for name in METHODS}
    try:
        for _ in range(repeats):
            for name in METHODS:
                times[name].append(methods[name].save_s())
    finally:
        for method in methods.values():
            method.close()
    result: dict[str, Any] = {"tensors": tensors, "repeats": repeats, "methods": {}, "loads": _loads(tensors, repeats, os.path.join(base, "ours"))}
    for name in METHODS:
        entry: dict[str, Any] = {"cold_s": methods[name].cold_s, "durable_s": times[name], "spread": spread(times[name])}
        phases = getattr(methods[name], "phases", None)
        if phases:
            later = phases[1:]  # the cold one apart
            entry["persist_phases_median_s"] = {k: sorted(p[k] for p in later)[len(later) // 2] for k in later[0]}
        result["methods"][name] = entry
    return result


def _report(result: dict[str, Any]) -> str:
    m = result["methods"]
    lines = [
        f"### Time to durable, {result['tensors']:,} small state tensors (64 bytes each), one local directory, fsync on",
        "",
        f"{result['machine']['cpu']}; torch {result['machine']['torch']}; {result['machine']['date_utc']}. "
        f"Median (min / p90 / max) of {result['repeats']} checkpoints per method, alternated; the cold first one apart.",
        "",
        "| method | request → durable | cold |",
        "|---|---|---|",
    ]
    for name in METHODS:
        lines.append(f"| {name} | {spread_text(m[name]['durable_s'])} | {m[name]['cold_s']:.2f} s |")
    ours, off, stock = (m[n]["spread"]["median"] for n in METHODS)
    lines += [
        "",
        f"overlapckpt against its templates off: {ours / off:.2f}×; against stock dcp.save: {ours / stock:.2f}×.",
        "",
        "Loads of overlapckpt's newest checkpoint into fresh objects, alternated (page cache warm):",
        "",
        "| load | seconds |",
        "|---|---|",
        *[f"| {name} | {spread_text(result['loads'][name]['s'])} |" for name in LOADS],
        "",
        "Where the writer's time went (median s per phase):",
        "",
        "| phase | overlapckpt | templates off |",
        "|---|---|---|",
    ]
    on_phases, off_phases = m["overlapckpt"]["persist_phases_median_s"], m["overlapckpt, templates off"]["persist_phases_median_s"]
    for phase in on_phases:
        lines.append(f"| {phase} | {on_phases[phase]:.3f} | {off_phases.get(phase, float('nan')):.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensors", type=int, default=30000, help="state tensors: a third parameters, two moments each")
    parser.add_argument("--repeats", type=int, default=MIN_REPEATS)
    parser.add_argument("--dir", default=None, help="a directory on the local disk (default: the system's temporary directory)")
    parser.add_argument("--out", default="benchmarks/results/many-tensors")
    args = parse_repeated(parser)
    torch.set_num_threads(1)
    base = tempfile.mkdtemp(prefix="overlapckpt-many-", dir=args.dir)
    try:
        result = run(args.tensors, args.repeats, base)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    result["machine"] = machine_description(torch.device("cpu"))
    result["command"] = f"python benchmarks/many_tensors.py --tensors {args.tensors} --repeats {args.repeats}"
    write_results(args.out, "many_tensors", result, _report(result))


if __name__ == "__main__":
    main()
