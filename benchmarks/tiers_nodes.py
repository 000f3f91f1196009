"""The local tier across 2 nodes: restore time by source, a partner's replica among them, and the step overhead of R=1.

    sudo python benchmarks/tiers_nodes.py [--mib 256] [--repeats 7] [--steps 40] [--train-mib 64]
                                          [--out benchmarks/results/tiers-nodes]

Two "nodes" are two network namespaces joined by a veth pair (``tests/netns_hosts.py``;
making them needs root), each running ``torchrun --nnodes 2 --nproc-per-node 1`` on this
machine. Each node's tier is a directory of its own under ``/dev/shm``; the root is one
directory on the temporary directory's disk, shared by both, as a cluster's shared
file system would be. One launch serves every figure (``--worker`` is that launch's rank).

**Restore.** One checkpoint of about ``--mib`` MiB of AdamW state per rank is committed
into both tiers with ``local_replicas=1`` (so each node holds both ranks' shards). Then,
per repeat, in an order that rotates, into a model and optimizer built just before, on a
Checkpointer constructed just before (its start is not timed):

- ``local tier``: ``ckpt.restore()`` with both tiers whole: each rank reads its own node's tier;
- ``a partner's replica``: node 1's tier moved away first (a replaced node): node 1's
  files are fetched from node 0 through the writers, then read;
- ``root``: both tiers moved away: ``ckpt.restore()`` reads the root;
- ``root: stock dcp.load``: ``dcp.load`` of the root's checkpoint over the trainers' group, unverified.

Timed: the ``restore()`` (or ``dcp.load``) call on each rank, the slower rank's time reported.

**Step overhead.** Per repeat, configurations rotating, ``--steps`` data-parallel AdamW
steps (one ``all_reduce`` per gradient) on ``--train-mib`` MiB of state per rank: no
checkpointing; the root alone every 10 steps; the local tier alone every 10 steps with
``local_replicas=1`` (each rank's shard also sent to the other node). Reported, past the
first 10 steps, the slower rank's: the mean step of each repeat (the checkpoint steps,
where a cadence's cost lands, included) and its median step.

Writes ``tiers-nodes.json`` and ``tiers-nodes.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

CADENCE_STEPS = 10
SOURCES = ("local tier", "a partner's replica", "root", "root: stock dcp.load")
CONFIGS = ("no checkpointing", f"root alone, every={CADENCE_STEPS}", f"local tier, local_every={CADENCE_STEPS}, local_replicas=1")
LAUNCH_TIMEOUT_S = 1800
PORT = 29600  # the namespaces are fresh: every port is free in them


# ---- the launch's ranks (under torchrun, one per namespace) ----


def _aside(tier: str) -> str:
    return tier + ".aside"


def _move_aside(tier: str) -> None:
    os.rename(tier, _aside(tier))
    os.makedirs(tier)


def _move_back(tier: str) -> None:
    shutil.rmtree(tier)
    os.rename(_aside(tier), tier)


def _restore_once(source: str, root: str, tier: str, mib: int, node: int) -> float:
    """One timed restore from ``source`` on this rank (the tiers arranged by the caller); seconds."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from load import build_model
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from overlapckpt import Checkpointer, list_checkpoints

    model, opt = build_model(mib)
    if source == "root: stock dcp.load":
        path = list_checkpoints(root)[-1].path
        msd, osd = get_state_dict(model, opt)
        dist.barrier()
        started = time.perf_counter()
        dcp.load({"model": msd, "optimizer": osd}, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
        return time.perf_counter() - started
    with Checkpointer(model, opt, root, lease=False, local_every=1000, local_dir=tier, local_replicas=1) as ckpt:
        dist.barrier()
        started = time.perf_counter()
        info = ckpt.restore()
        seconds = time.perf_counter() - started
    expected = root if source == "root" else tier
    if not info.path.startswith(expected):
        raise RuntimeError(f"rank on node {node}: the restore from {source!r} read {info.path}, not under {expected}")
    return seconds


def _train_loop(steps: int, mib: int, settings: dict[str, Any] | None, root: str) -> list[float]:
    import torch
    import torch.distributed as dist
    from load import build_model

    from overlapckpt import Checkpointer

    model, opt = build_model(mib)
    x = torch.randn(4, model[0].in_features)
    ckpt = None if settings is None else Checkpointer(model, opt, root, lease=False, **settings)
    world = dist.get_world_size()
    times = []
    try:
        dist.barrier()
        for _ in range(steps):
            started = time.perf_counter()
            model(x).square().mean().backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad.div_(world)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if ckpt is not None:
                ckpt.step()
            times.append(time.perf_counter() - started)
    finally:
        if ckpt is not None:
            ckpt.close()
    return times


def _slowest(seconds: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=600))  # a failed rank ends the launch, not 30 min later
    torch.set_num_threads(1)
    rank, node = dist.get_rank(), int(os.environ["GROUP_RANK"])
    tier = os.path.join(args.tiers, f"node{node}")
    restore_root = os.path.join(args.base, "restore-root")
    result: dict[str, Any] = {
        "restore_s": {s: [] for s in SOURCES}, "step_s": {c: [] for c in CONFIGS}, "median_step_s": {c: [] for c in CONFIGS},
    }
    from tiers import commit_both_tiers

    commit_both_tiers(restore_root, tier, args.mib)  # local_replicas defaults to 1: each node holds both ranks' shards
    dist.barrier()
    for index in range(args.repeats + 1):  # the first round is untimed: imports, first mappings
        for source in SOURCES[index % len(SOURCES):] + SOURCES[: index % len(SOURCES)]:
            moved = (source == "a partner's replica" and node == 1) or source == "root"
            if moved:
                _move_aside(tier)
            dist.barrier()
            seconds = _slowest(_restore_once(source, restore_root, tier, args.mib, node))
            if moved:
                _move_back(tier)
            if index > 0:
                result["restore_s"][source].append(seconds)
            dist.barrier()
    settings: dict[str, dict[str, Any] | None] = {
        CONFIGS[0]: None,
        CONFIGS[1]: {"every": CADENCE_STEPS, "keep": 2},
        CONFIGS[2]: {"local_every": CADENCE_STEPS, "local_keep": 2, "local_replicas": 1},
    }
    loop_root, loop_tier = os.path.join(args.base, "loop-root"), os.path.join(args.tiers, f"loop-node{node}")
    for index in range(args.repeats):
        for name in CONFIGS[index % len(CONFIGS):] + CONFIGS[: index % len(CONFIGS)]:
            config = settings[name]
            if rank == 0:
                shutil.rmtree(loop_root, ignore_errors=True)
            shutil.rmtree(loop_tier, ignore_errors=True)
            dist.barrier()
            if config is not None and "local_every" in config:
                config = {**config, "local_dir": loop_tier}
            times = _train_loop(args.steps, args.train_mib, config, loop_root)[CADENCE_STEPS:]
            # The mean carries the checkpoint steps (1 in 10), where a cadence's cost lands; the median shows the rest.
            result["step_s"][name].append(_slowest(statistics.fmean(times)))
            result["median_step_s"][name].append(_slowest(statistics.median(times)))
    if rank == 0:
        with open(args.result, "w") as f:
            json.dump(result, f)
    dist.barrier()
    os._exit(0)  # gloo's teardown can abort at exit


# ---- the launcher (this machine, root) ----


def _kill_processes_naming(needle: str) -> None:
    """SIGKILL the launch's leftovers: torchrun gives each worker a session of its own, so a killed agent leaves them."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if needle.encode() in f.read():
                    os.kill(int(pid), signal.SIGKILL)
        except OSError:
            continue


def launch(args: argparse.Namespace) -> dict[str, Any]:
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
    from netns_hosts import two_hosts

    base = tempfile.mkdtemp(prefix="tiers-nodes-")
    tiers = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None, prefix="overlapckpt-bench-nodes-")
    result_path = os.path.join(base, "result.json")
    try:
        with two_hosts() as hosts:
            port = PORT
            procs = []
            for node, (ns, ifname, _) in enumerate(hosts):
                env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=ifname, TORCHELASTIC_ERROR_FILE="")
                command = [
                    "ip", "netns", "exec", ns, sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                    "--nproc-per-node", "1", "--node-rank", str(node), "--master-addr", hosts[0][2], "--master-port", str(port),
                    os.path.abspath(__file__), "--worker", "--base", base, "--tiers", tiers, "--result", result_path,
                    "--mib", str(args.mib), "--train-mib", str(args.train_mib), "--steps", str(args.steps), "--repeats", str(args.repeats),
                ]
                procs.append(
                    subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
                )
            try:
                outputs = [p.communicate(timeout=LAUNCH_TIMEOUT_S)[0] for p in procs]
            finally:  # before the namespaces go: nothing of the launch may outlive it
                for p in procs:
                    if p.poll() is None:
                        os.killpg(p.pid, signal.SIGKILL)
                _kill_processes_naming(base)
        if not os.path.exists(result_path):
            raise RuntimeError("the launch wrote no result; its output:\n" + "\n".join(o[-4000:] for o in outputs))
        with open(result_path) as f:
            return dict(json.load(f))
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(tiers, ignore_errors=True)


def report(result: dict[str, Any]) -> str:
    from stats import spread, spread_text

    machine = result["machine"]
    lines = [
        f"# The local tier on 2 nodes x 1 rank ({machine['date_utc']}, {machine['cpu_count']} CPUs, torch {machine['torch']}, "
        f"commit {machine.get('commit')})",
        "",
        f"`{result['command']}`",
        "",
        "Two network namespaces on one machine; each node's tier on /dev/shm, the root on the temporary directory's disk "
        "(page cache warm). Seconds of the slower rank.",
        "",
        f"## Restore, {result['mib']} MiB of AdamW state per rank, fresh objects and Checkpointer per restore",
        "",
        "| source | seconds: median (min / p90 / max) | × stock dcp.load from the root, median |",
        "|---|---|---|",
    ]
    stock = spread(result["restore_s"]["root: stock dcp.load"])["median"]
    for name, values in result["restore_s"].items():
        lines.append(f"| {name} | {spread_text(values)} | {spread(values)['median'] / stock:.2f}× |")
    lines += [
        "",
        f"## Step time, {result['train_mib']} MiB of AdamW state per rank, {result['steps']} steps per repeat, "
        "past the first 10: the mean step of each repeat (checkpoint steps included) and its median step",
        "",
        "| configuration | mean step ms: median of repeats (min / p90 / max) | × no checkpointing | median step ms, median of repeats | × no checkpointing |",
        "|---|---|---|---|---|",
    ]
    none = spread(result["step_s"]["no checkpointing"])["median"]
    none_median = spread(result["median_step_s"]["no checkpointing"])["median"]
    for name, values in result["step_s"].items():
        medians = spread(result["median_step_s"][name])["median"]
        lines.append(
            f"| {name} | {spread_text(values, 'ms', 1000.0, 1)} | {spread(values)['median'] / none:.3f}× | {medians * 1000:.1f} ms | "
            f"{medians / none_median:.3f}× |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    from stats import MIN_REPEATS, parse_repeated

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=256, help="state per rank for the restore figures")
    parser.add_argument("--train-mib", type=int, default=64, help="state per rank for the step-overhead loop")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=MIN_REPEATS)
    parser.add_argument("--out", default="benchmarks/results/tiers-nodes")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--base", help=argparse.SUPPRESS)
    parser.add_argument("--tiers", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parse_repeated(parser)
    if args.worker:
        worker(args)
        return
    import pytest
    from measure import run_header, write_results

    try:
        figures = launch(args)
    except pytest.skip.Exception as e:  # tests/netns_hosts.py: no namespaces here (not root, no iproute2)
        sys.exit(f"tiers_nodes.py measures nothing here: {e}")
    result = {**run_header(), "mib": args.mib, "train_mib": args.train_mib, "steps": args.steps, **figures}
    write_results(args.out, "tiers-nodes", result, report(result))


if __name__ == "__main__":
    main()
