"""The multi-rank benchmark: overlapckpt against ``dcp.async_save`` on N CPU ranks (gloo), DDP and FSDP2.

    python benchmarks/harness.py --nproc 2 --size tiny --out benchmarks/results/cpu-2rank

``harness.py`` dispatches here when ``--nproc`` > 1. Per parallelism (``ddp``, ``fsdp2``)
this module launches N worker processes of itself (RANK, WORLD_SIZE, MASTER_ADDR and a
free MASTER_PORT set, as torchrun would), and every rank runs the single-process
harness's ``run_method`` on its own share of the same workload, method after method.
Each rank writes its raw step times and records to ``rank<R>.json``; the launcher turns
them into figures with ``report.summarize_method``, per rank against that rank's own
baseline, and writes ``results.json`` and ``results.md``.

Host-copy bytes per rank: overlapckpt's ``copied_nbytes`` (its share of the state, plus
replay's gradients); for ``dcp.async_save``, the bytes its stager put into its staging
copy on that rank, counted on the staged state dict.
"""

from __future__ import annotations

import inspect
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]

from measure import machine_description, pinned_copy_peak_bytes_per_s  # noqa: E402
from methods import DcpAsyncSave, Method, NoCheckpoint, Overlapckpt, async_save_features  # noqa: E402
from report import MIB, _ms, summarize_method  # noqa: E402
from workload import Workload  # noqa: E402

PARALLELISMS = ("ddp", "fsdp2")
# Launches that outlive every method's commit timeout by this much are killed.
LAUNCH_SLACK_S = 120.0


def local_nbytes(tree: Any) -> int:
    """Bytes of the tensors in a (nested) state dict that live on this rank: a DTensor's local shard."""
    from torch.distributed.tensor import DTensor

    if isinstance(tree, DTensor):
        return local_nbytes(tree.to_local())
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(local_nbytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(local_nbytes(v) for v in tree)
    return 0


class DistWorkload(Workload):
    """The single-process workload on every rank, wrapped in DDP or sharded with FSDP2.

    Every rank builds the same initial model (the same seed) and draws its own tokens,
    as data-parallel ranks do.
    """

    def __init__(self, size_name: str, parallelism: str, seed: int = 0) -> None:
        super().__init__(size_name, torch.device("cpu"), seed)
        self.parallelism = parallelism
        self._generator = torch.Generator(device="cpu").manual_seed(seed + 1 + dist.get_rank())
        if parallelism == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            self.model = DistributedDataParallel(self.model)
        elif parallelism == "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
            for block in self.model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(self.model, mesh=mesh)
        else:
            raise ValueError(f"parallelism={parallelism!r} is unknown; use one of {PARALLELISMS}")
        # FSDP2 replaced the parameters with DTensors: the optimizer must hold those (same settings).
        accepted = inspect.signature(type(self.optimizer)).parameters  # defaults hold derived keys too
        settings = {k: v for k, v in self.optimizer.defaults.items() if k in accepted}
        self.optimizer = type(self.optimizer)(self.model.parameters(), **settings)

    def local_state_nbytes(self) -> int:
        """This rank's part of the state: all of it under DDP, its shards (and step counters) under FSDP2."""
        return local_nbytes(self.model.state_dict()) + local_nbytes([st for st in self.optimizer.state.values()])

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "parallelism": self.parallelism, "world_size": dist.get_world_size()}


def _counting_stager_type() -> type:
    """DefaultStager, counting the bytes each synchronous stage copied (read from the staged state dict)."""
    from torch.distributed.checkpoint.staging import DefaultStager

    class CountingStager(DefaultStager):
        last_staged_nbytes: int | None = None

        def stage(self, state_dict: Any, **kwargs: Any) -> Any:
            staged = super().stage(state_dict, **kwargs)
            if isinstance(staged, dict):  # CPU: staging is synchronous; async staging returns a Future
                self.last_staged_nbytes = local_nbytes(staged)
            return staged

    return CountingStager


class DistDcpAsyncSave(DcpAsyncSave):
    """``dcp.async_save`` on every rank; each record carries the bytes staged on this rank."""

    def start(self, workload: Workload, directory: str) -> None:
        if async_save_features()["default_stager"]:
            self.stager_type = _counting_stager_type()
        super().start(workload, directory)

    def save(self, step: int) -> None:
        super().save(step)
        staged = getattr(self._stager, "last_staged_nbytes", None)
        if staged is not None:
            self.records[-1].extra["copied_nbytes"] = staged


def dist_methods() -> list[Method]:
    """Baseline, dcp.async_save (PROCESS where this torch has checkpointer types: the daemon keeps its
    own process group, so its collectives never interleave with DDP's or FSDP2's), overlapckpt."""
    kind = "PROCESS" if async_save_features()["async_checkpointer_type"] else "THREAD"
    return [NoCheckpoint(), DistDcpAsyncSave(kind), Overlapckpt(1), Overlapckpt(4, "replay"), Overlapckpt(4, "stage")]


# ---- one rank ----------------------------------------------------------------------------


def _worker(spec_path: str) -> None:
    """One rank: every method on its share of the workload, raw figures to ``rank<R>.json``."""
    from harness import run_method

    with open(spec_path) as f:
        spec = json.load(f)
    dist.init_process_group("gloo", timeout=timedelta(seconds=spec["timeout_s"]))
    rank = dist.get_rank()
    torch.set_num_threads(spec["train_threads"])
    result: dict[str, Any] = {"rank": rank, "methods": {}, "failed": {}}
    try:
        workload = DistWorkload(spec["size"], spec["parallelism"])
        for _ in range(2):  # creates the optimizer state, so every method checkpoints the same bytes
            workload.forward_backward()
            workload.optimizer_step()
        result.update(
            workload=workload.describe(),
            state_nbytes=workload.state_nbytes(),  # global: a DTensor counts its full size
            local_state_nbytes=workload.local_state_nbytes(),
            copy_peak=pinned_copy_peak_bytes_per_s(workload.device, workload.local_state_nbytes()),
            train_threads=torch.get_num_threads(),
        )
        wanted = spec["methods"]
        for method in [m for m in dist_methods() if wanted is None or m.name in wanted]:
            dist.barrier()  # every rank starts a method together: their steps meet in collectives anyway
            try:
                result["methods"][method.name] = run_method(method, workload, spec["plan"], spec["root"], spec["timeout_s"])
            except Exception as e:  # reported; the other rank will likely fail at its next collective too
                if method.name == "baseline":
                    raise
                result["failed"][method.name] = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}"
                try:
                    method.close()
                except Exception:
                    pass
    except BaseException:
        result["crashed"] = traceback.format_exc()
    with open(os.path.join(spec["out"], f"rank{rank}.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    try:
        dist.barrier()
    finally:
        os._exit(0)  # gloo's teardown can abort; the result is written


# ---- the launcher ------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(spec: dict[str, Any], nproc: int, launch_timeout_s: float) -> list[dict[str, Any]]:
    os.makedirs(spec["out"], exist_ok=True)
    spec_path = os.path.join(spec["out"], "spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    port = _free_port()
    procs = []
    for rank in range(nproc):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS=str(spec["train_threads"]))
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", spec_path], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=launch_timeout_s)[0])
    except subprocess.TimeoutExpired:
        outputs.append(f"killed after {launch_timeout_s:.0f} s")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    ranks = []
    for rank in range(nproc):
        path = os.path.join(spec["out"], f"rank{rank}.json")
        if not os.path.exists(path):
            tail = "\n".join(o[-3000:] for o in outputs)
            raise RuntimeError(f"rank {rank} of the {spec['parallelism']} launch wrote no result; its output:\n{tail}")
        with open(path) as f:
            ranks.append(json.load(f))
        if "crashed" in ranks[-1]:
            raise RuntimeError(f"rank {rank} of the {spec['parallelism']} launch crashed:\n{ranks[-1]['crashed']}")
    return ranks


def run_distributed(args: Any) -> dict[str, Any]:
    """``harness.py --nproc N``: launch each parallelism in turn, then write results.json and results.md."""
    parallelisms = [p for p in args.parallelism.split(",") if p]
    unknown = [p for p in parallelisms if p not in PARALLELISMS]
    if unknown:
        raise SystemExit(f"--parallelism {unknown} is unknown; choose from {PARALLELISMS}")
    names = [m.name for m in dist_methods()]
    wanted = None
    if args.methods != "all":
        wanted = ["baseline"] + [n for n in args.methods.split(",") if n and n != "baseline"]
        if set(wanted) - set(names):
            raise SystemExit(f"unknown method(s) {sorted(set(wanted) - set(names))} with --nproc; choose from {names}")
    plan = {"every": args.every, "warmup": args.warmup, "stall_checkpoints": args.checkpoints,
            "quiet_steps": args.quiet_steps, "throughput_checkpoints": args.throughput_checkpoints,
            "train_threads": args.train_threads or 1}
    root = args.checkpoint_dir or tempfile.mkdtemp(prefix="overlapckpt-dist-bench-")
    os.makedirs(args.out, exist_ok=True)
    result: dict[str, Any] = {
        "machine": machine_description(torch.device("cpu")),
        "nproc": args.nproc,
        "plan": plan,
        "checkpoint_dir": root,
        "load_average_before": os.getloadavg(),
        "parallelisms": {},
    }
    for parallelism in parallelisms:
        started = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix=f"dist-bench-{parallelism}-") as scratch:
            spec = {"parallelism": parallelism, "size": args.size, "plan": plan, "methods": wanted, "timeout_s": args.timeout_s,
                    "train_threads": plan["train_threads"], "root": os.path.join(root, parallelism), "out": scratch}
            count = len(wanted or names)
            ranks = _launch(spec, args.nproc, count * args.timeout_s + LAUNCH_SLACK_S)
        result["parallelisms"][parallelism] = _summarize(ranks, plan["every"])
        result["parallelisms"][parallelism]["wall_s"] = time.perf_counter() - started
        print(f"  {parallelism:<6} {time.perf_counter() - started:6.1f} s", flush=True)
    result["load_average_after"] = os.getloadavg()
    table = markdown_tables(result)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(table)
    print(table)
    return result


def _summarize(ranks: list[dict[str, Any]], every: int) -> dict[str, Any]:
    """Each rank's methods against that rank's own baseline, as the single-process report does."""
    for r in ranks:
        base = r["methods"]["baseline"]
        for run in r["methods"].values():
            run["metrics"] = summarize_method(run, base, every, r["copy_peak"]["bytes_per_s"])
            stall = [rec for rec in run["records"] if rec["phase"] == "stall"]
            copied = [rec["copied_nbytes"] for rec in stall if rec.get("copied_nbytes")]
            run["metrics"]["host_copy_nbytes_per_checkpoint"] = statistics.median(copied) if copied else None
        r["baseline_median_step_s"] = statistics.median(base["step_times_s"])
    first = ranks[0]
    return {"workload": first["workload"], "state_nbytes": first["state_nbytes"], "ranks": ranks,
            "failed": {k: v for r in ranks for k, v in r["failed"].items()}}


def markdown_tables(result: dict[str, Any]) -> str:
    m, plan = result["machine"], result["plan"]
    lines = []
    for parallelism, part in result["parallelisms"].items():
        w, state = part["workload"], part["state_nbytes"]
        ranks = part["ranks"]
        lines += [
            f"### {parallelism.upper()} on {result['nproc']} CPU ranks (gloo): {w['size']} workload, "
            f"{w['parameters'] / 1e6:.1f} M parameters, {state / MIB:.1f} MiB of state",
            "",
            f"{m['cpu']}, {m['cpu_count']} cores, {plan['train_threads']} training thread(s) per rank; torch {m['torch']}; "
            f"{m['date_utc']}; 1-minute load average {result['load_average_before'][0]:.2f} before the run and "
            f"{result['load_average_after'][0]:.2f} after it (other work on the machine shows here). Per method and rank: "
            f"{plan['stall_checkpoints']} checkpoints timed alone ({plan['quiet_steps']} steps without, then the request "
            f"and {plan['every']} steps), then {plan['throughput_checkpoints']} every {plan['every']} steps. Baseline median "
            f"step: " + ", ".join(f"rank {r['rank']} {_ms(r['baseline_median_step_s'])} ms" for r in ranks) + ". "
            "Rank-local state: " + ", ".join(f"rank {r['rank']} {r['local_state_nbytes'] / MIB:.1f} MiB" for r in ranks) + ".",
            "",
            "| method | rank | host-copy MiB / ckpt (of state) | stall / ckpt ms | max step inflation ms | blocking / ckpt ms | request→commit s | throughput vs baseline |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name in ranks[0]["methods"]:
            for r in ranks:
                run = r["methods"].get(name)
                if run is None:
                    continue
                x = run["metrics"]
                copied = x["host_copy_nbytes_per_checkpoint"]
                copied_s = "–" if copied is None else f"{copied / MIB:.1f} ({copied / state * 100:.0f}%)"
                commit = "–" if x["mean_request_to_commit_s"] is None else f"{x['mean_request_to_commit_s']:.2f}"
                lines.append(
                    f"| {run['label']} | {r['rank']} | {copied_s} | {_ms(x['mean_stall_per_checkpoint_s'])} "
                    f"({_ms(x['mean_stall_vs_own_quiet_steps_s'])}) | {_ms(x['max_step_inflation_s'])} "
                    f"({_ms(x['max_step_inflation_vs_own_quiet_steps_s'])}) | {_ms(x['mean_blocking_s'])} | {commit} | "
                    f"{x['throughput_vs_baseline'] * 100:.1f}% |"
                )
        if part["failed"]:
            lines += ["", "Failed: " + "; ".join(f"{k}: {v.splitlines()[0]}" for k, v in part["failed"].items())]
        lines.append("")
    lines += [
        "Stall and inflation: against the rank's own baseline median step; in brackets, against the method's own "
        "steps just before each checkpoint. Host-copy bytes: overlapckpt's `copied_nbytes` (its share, plus replay's "
        "gradients); dcp.async_save's, the bytes its stager staged on the rank. The ranks meet in every step's "
        "collectives, so a stall on one rank shows on both.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if sys.argv[1:2] != ["--worker"] or len(sys.argv) != 3:
        raise SystemExit("run through benchmarks/harness.py --nproc N; this module's own entry is the worker's")
    _worker(sys.argv[2])
