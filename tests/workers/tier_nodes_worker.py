"""One rank of a 2-node x 2-rank job for tests/test_tier_nodes.py, launched by torchrun in each node's namespace.

    torchrun --nnodes 2 --nproc-per-node 2 --node-rank N ... tier_nodes_worker.py PHASE OUT ROOT TIERS

PHASE is ``sharded_first`` or ``sharded_resume`` (as ``first`` and ``resume``, the model under
FSDP2 across every rank: each rank reads its own shard at a restore, launched as 3 nodes x 1 rank),
``kill`` (rank 3 SIGKILLs its own writer while version 2's replicas are sent;
``kill_during_replication``), ``preempt`` (trained until torchrun's agents forward a SIGTERM;
``preempted``), ``first`` (data parallel, train STEPS steps, a local-tier checkpoint every LOCAL_EVERY, the root
every ROOT_EVERY; the uninterrupted twin) or ``resume`` (``ckpt.restore()``, then train to
STEPS). Node N's tier is TIERS/node<N>. Each rank writes OUT/<phase>-rank<R>.json (what it
restored, its losses) and OUT/<phase>-rank<R>.pt (its final model and optimizer state),
passes a barrier and leaves with os._exit(0), as a killed job would: nothing is closed.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository

from overlapckpt import Checkpointer  # noqa: E402

from helpers import LogLines, StatefulSampler, TinyNet, write_rank_result_and_leave  # noqa: E402

STEPS = 8
LOCAL_EVERY = 3  # local-tier checkpoints at 3 and 6; step 8's state is only the twin's
ROOT_EVERY = 6


def run(phase: str, out: str, root: str, tiers: str) -> dict[str, Any]:
    rank, node = dist.get_rank(), int(os.environ["GROUP_RANK"])
    records = LogLines()
    for name in ("overlapckpt", "overlapckpt.restore"):
        logging.getLogger(name).addHandler(records)
        logging.getLogger(name).setLevel(logging.INFO)
    torch.manual_seed(0)
    # Data parallel with one all_reduce per gradient, in a fixed order: DDP regroups its buckets
    # after a process's first step, and with 4 ranks the order of a ring's sums moves with them,
    # so a resumed DDP run differs from its twin in the last bits, whatever it restored. Buffers
    # are broadcast from rank 0 before each forward, as DDP does.
    model = TinyNet(width=32, features=16, outputs=8, dropout=0.2)
    sharded = phase.startswith("sharded_")
    if sharded:  # FSDP2 over every rank: parameters and optimizer state sharded, BatchNorm's buffers whole
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in (model.inp, model.out):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sampler = StatefulSampler(seed=100 + rank, features=16, outputs=8)
    result: dict[str, Any] = {"node": node}
    ckpt = Checkpointer(
        model, opt, root, stateful={"sampler": sampler}, every=ROOT_EVERY, local_every=LOCAL_EVERY, local_keep=2,
        local_dir=os.path.join(tiers, f"node{node}"), replica_mib_per_s=64,
    )
    start = 1
    if phase.endswith("resume"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            info = ckpt.restore()
        result.update(
            restored_step=info.step, restored_path=info.path, warnings=[str(w.message) for w in caught], restore_figures=ckpt.restore_figures,
        )
        start = info.step + 1
    losses: dict[int, float] = {}
    for it in range(start, STEPS + 1):
        x, y = sampler.next_batch(16)
        for buffer in model.buffers():  # BatchNorm's statistics: rank 0's on every rank, as DDP keeps them
            dist.broadcast(buffer, 0)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        for p in () if sharded else model.parameters():  # FSDP2 reduce-scatters its gradients itself
            dist.all_reduce(p.grad)
            p.grad.div_(dist.get_world_size())
        opt.step()
        losses[it] = float(loss.detach())
        ckpt.step()
    result["committed"] = [(i.step, i.path) for i in ckpt.wait(timeout_s=120)]
    result["round_nodes"] = [s["writer_round_nodes"] for s in ckpt.stats]  # the writers' rounds through each node's leader
    result["losses"] = losses
    result["log"] = records.lines
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    torch.save(_local_parts(state), os.path.join(out, f"{phase}-rank{rank}.pt"))
    return result


def _local_parts(value: Any) -> Any:
    """``value`` with each DTensor replaced by this rank's part of it (what ``torch.load(weights_only=True)`` reads back)."""
    to_local = getattr(value, "to_local", None)
    if isinstance(value, torch.Tensor) and callable(to_local):
        return to_local().clone()
    if isinstance(value, dict):
        return {k: _local_parts(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_local_parts(v) for v in value]
    return value


def kill_during_replication(out: str, root: str, tiers: str) -> dict[str, Any]:
    """Rank 3 SIGKILLs its own writer while version 2's replicas are being sent; version 4 must commit everywhere."""
    rank, node = dist.get_rank(), int(os.environ["GROUP_RANK"])
    logging.basicConfig(level=logging.INFO, format=f"[rank {rank} %(asctime)s] %(name)s: %(message)s")
    torch.manual_seed(0)
    model = TinyNet(width=256, features=16, outputs=8, dropout=0.0)  # ~200 KiB of state per rank: seconds at the cap below
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sampler = StatefulSampler(seed=100 + rank, features=16, outputs=8)
    tier = os.path.join(tiers, f"node{node}")
    ckpt = Checkpointer(model, opt, root, local_every=2, local_keep=4, local_dir=tier, replica_mib_per_s=0.05, collective_timeout_s=20)
    killed: list[str | None] = []
    watcher = None
    if rank == 3:
        # On a side thread: training goes on while it watches (a stalled training thread made rank 3
        # reach version 2 a minute after the others, which this test is not about).
        watcher = threading.Thread(target=lambda: killed.append(_kill_writer_once_replicas_flow(ckpt.writer_pid, tier, timeout_s=120)))
        watcher.start()
    for it in range(1, 5):
        x, y = sampler.next_batch(16)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        ckpt.step()
        logging.getLogger("worker").info("step %d done", it)
    if watcher is not None:
        watcher.join(timeout=180)
    errors: list[str] = []
    try:
        committed = [(i.step, i.path) for i in ckpt.wait(timeout_s=120)]
    except Exception as e:  # noqa: BLE001 - reported to the test
        committed, errors = [], [f"{type(e).__name__}: {e}"]
    return {"node": node, "killed": killed[0] if killed else None, "committed": committed, "errors": errors, "restarts": ckpt.writer_restarts}


def kill_in_root_write(out: str, root: str) -> dict[str, Any]:
    """Root checkpoints only, every 2 steps: rank 3's writer hangs in its first shard write of version 2 (fakes.BlockingOnceStore)
    and is SIGKILLed there, while its node's leader (rank 2) waits for it in the write round's gather through the nodes' leaders.
    Version 2 is lost on every rank; 4 and 6 commit on every rank."""
    import fakes

    rank = dist.get_rank()
    fifo = os.path.join(out, "root-kill.fifo")
    os.environ[fakes.BLOCK_ONCE_MARKER_ENV] = os.path.join(out, f"blocked-once-rank{rank}")
    if rank == 3:
        os.environ[fakes.BLOCK_FIFO_ENV] = fifo
        os.environ[fakes.ONLY_NAME_ENV] = "step-000000002"
        os.mkfifo(fifo)
    else:
        os.environ[fakes.ONLY_NAME_ENV] = "none"
    torch.manual_seed(0)
    model = TinyNet(width=32, features=16, outputs=8, dropout=0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sampler = StatefulSampler(seed=100 + rank, features=16, outputs=8)
    records = LogLines()
    logging.getLogger("overlapckpt").addHandler(records)
    ckpt = Checkpointer(model, opt, root, every=2, store_class=fakes.BlockingOnceStore, collective_timeout_s=60, agreement_timeout_s=60)
    killed: list[bool] = []
    killer = None
    if rank == 3:

        def kill_when_writing() -> None:
            with open(fifo) as f:  # the writer announces it is inside its shard write
                f.readline()
            os.kill(ckpt.writer_pid, signal.SIGKILL)
            killed.append(True)

        killer = threading.Thread(target=kill_when_writing, daemon=True)
        killer.start()
    errors: list[str] = []
    for it in range(1, 7):
        _data_parallel_step(model, opt, sampler, mean=True)
        ckpt.step()
        if it == 3 and killer is not None:
            killer.join(timeout=120)
        if it in (2, 4, 6):
            try:
                ckpt.wait(timeout_s=150)  # each version settled (committed, or lost) before the next
            except Exception as e:  # noqa: BLE001 - reported to the test
                errors.append(f"{type(e).__name__}: {e}")
    committed = [s["step"] for s in ckpt.stats]
    return {"killed": bool(killed), "committed": committed, "errors": errors, "restarts": ckpt.writer_restarts,
            "round_nodes": [s["writer_round_nodes"] for s in ckpt.stats], "log": records.lines}


def _data_parallel_step(model: nn.Module, opt: torch.optim.Optimizer, sampler: StatefulSampler, mean: bool) -> None:
    """One step with the gradients summed over the ranks (``mean``: then divided by their count), as DDP would."""
    x, y = sampler.next_batch(16)
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        if mean:
            p.grad.div_(dist.get_world_size())
    opt.step()


def _kill_writer_once_replicas_flow(pid: int, tier: str, timeout_s: float) -> str | None:
    """SIGKILL the writer once a replica is arriving in this node's tier (a ``.replica-part`` file); what was seen."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for directory, _, files in os.walk(tier):
            arriving = [f for f in files if f.endswith(".replica-part")]
            if arriving:
                os.kill(pid, signal.SIGKILL)
                return os.path.join(directory, arriving[0])
        time.sleep(0.01)  # polling the directory: there is nothing to wait on
    return None


def preempted(out: str, root: str, tiers: str) -> None:
    """Train until a SIGTERM from torchrun's agent; overlapckpt's guard saves to both tiers, then chains to our handler.

    Replicas are capped at 1 KiB/s: only a preemption that lifts the cap commits in the grace.
    Our handler writes OUT/preempt-rank<R>.json (the step it stopped at, what each tier lists)
    and exits with the signal. Prints ``READY <rank>`` once past step 3.
    """
    from overlapckpt import list_checkpoints

    rank, node = dist.get_rank(), int(os.environ["GROUP_RANK"])
    tier = os.path.join(tiers, f"node{node}")
    step = 0

    def on_sigterm(signum: int, frame: object) -> None:
        result = {"node": node, "last_step": step, "local": [i.step for i in list_checkpoints(tier)], "root": [i.step for i in list_checkpoints(root)]}
        with open(os.path.join(out, f"preempt-rank{rank}.json"), "w") as f:
            json.dump(result, f)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)  # exit with the signal's status

    signal.signal(signal.SIGTERM, on_sigterm)  # before the Checkpointer: its guard chains to it
    torch.manual_seed(0)
    model = TinyNet(width=256, features=16, outputs=8, dropout=0.0)  # ~200 KiB of state per rank: minutes at the cap below
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sampler = StatefulSampler(seed=100 + rank, features=16, outputs=8)
    ckpt = Checkpointer(
        model, opt, root, local_every=1000, local_dir=tier, replica_mib_per_s=1 / 1024, save_on_signal=(signal.SIGTERM,),
    )
    for step in range(1, 100_000):  # the signal ends it, long before
        _data_parallel_step(model, opt, sampler, mean=False)
        ckpt.step()
        if step == 3:
            os.write(sys.stdout.fileno(), f"READY {rank}\n".encode())  # one write: the other rank's line cannot split it
    raise AssertionError("no preemption came: 100,000 steps trained without a SIGTERM")


def main() -> None:
    phase, out, root, tiers = sys.argv[1:5]
    dist.init_process_group("gloo", timeout=timedelta(seconds=180))
    scenarios: dict[str, Callable[[], dict[str, Any]]] = {
        "preempt": lambda: preempted(out, root, tiers),  # exits by the signal
        "kill": lambda: kill_during_replication(out, root, tiers),
        "root_kill": lambda: kill_in_root_write(out, root),
        "first": lambda: run(phase, out, root, tiers),
        "resume": lambda: run(phase, out, root, tiers),
        "sharded_first": lambda: run(phase, out, root, tiers),
        "sharded_resume": lambda: run(phase, out, root, tiers),
    }
    write_rank_result_and_leave(os.path.join(out, f"{phase}-rank{dist.get_rank()}.json"), lambda: scenarios[phase]())


if __name__ == "__main__":
    main()
