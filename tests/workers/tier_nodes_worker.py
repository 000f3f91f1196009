"""One rank of a 2-node x 2-rank job for tests/test_tier_nodes.py, launched by torchrun in each node's namespace.

    torchrun --nnodes 2 --nproc-per-node 2 --node-rank N ... tier_nodes_worker.py PHASE OUT ROOT TIERS

PHASE is ``first`` (data parallel, train STEPS steps, a local-tier checkpoint every LOCAL_EVERY, the root
every ROOT_EVERY; the uninterrupted twin) or ``resume`` (``ckpt.restore()``, then train to
STEPS). Node N's tier is TIERS/node<N>. Each rank writes OUT/<phase>-rank<R>.json (what it
restored, its losses) and OUT/<phase>-rank<R>.pt (its final model and optimizer state),
passes a barrier and leaves with os._exit(0), as a killed job would: nothing is closed.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import traceback
import warnings
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository

from overlapckpt import Checkpointer  # noqa: E402

from helpers import StatefulSampler, TinyNet  # noqa: E402

STEPS = 8
LOCAL_EVERY = 3  # local-tier checkpoints at 3 and 6; step 8's state is only the twin's
ROOT_EVERY = 6


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def run(phase: str, out: str, root: str, tiers: str) -> dict[str, Any]:
    rank, node = dist.get_rank(), int(os.environ["GROUP_RANK"])
    records = _Records()
    for name in ("overlapckpt", "overlapckpt.restore"):
        logging.getLogger(name).addHandler(records)
        logging.getLogger(name).setLevel(logging.INFO)
    torch.manual_seed(0)
    # Data parallel with one all_reduce per gradient, in a fixed order: DDP regroups its buckets
    # after a process's first step, and with 4 ranks the order of a ring's sums moves with them,
    # so a resumed DDP run differs from its twin in the last bits, whatever it restored. Buffers
    # are broadcast from rank 0 before each forward, as DDP does.
    model = TinyNet(width=32, features=16, outputs=8, dropout=0.2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sampler = StatefulSampler(seed=100 + rank, features=16, outputs=8)
    result: dict[str, Any] = {"node": node}
    ckpt = Checkpointer(
        model, opt, root, stateful={"sampler": sampler}, every=ROOT_EVERY, local_every=LOCAL_EVERY, local_keep=2,
        local_dir=os.path.join(tiers, f"node{node}"), replica_mib_per_s=64,
    )
    start = 1
    if phase == "resume":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            info = ckpt.restore()
        result.update(restored_step=info.step, restored_path=info.path, warnings=[str(w.message) for w in caught])
        start = info.step + 1
    losses: dict[int, float] = {}
    for it in range(start, STEPS + 1):
        x, y = sampler.next_batch(16)
        for buffer in model.buffers():  # BatchNorm's statistics: rank 0's on every rank, as DDP keeps them
            dist.broadcast(buffer, 0)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad.div_(dist.get_world_size())
        opt.step()
        losses[it] = float(loss.detach())
        ckpt.step()
    result["committed"] = [(i.step, i.path) for i in ckpt.wait(timeout_s=120)]
    result["losses"] = losses
    result["log"] = records.lines
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, os.path.join(out, f"{phase}-rank{rank}.pt"))
    return result


def main() -> None:
    phase, out, root, tiers = sys.argv[1:5]
    dist.init_process_group("gloo", timeout=timedelta(seconds=180))
    rank = dist.get_rank()
    try:
        result = run(phase, out, root, tiers)
    except BaseException:
        result = {"crashed": traceback.format_exc()}
    with open(os.path.join(out, f"{phase}-rank{rank}.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    try:
        dist.barrier()
    finally:
        os._exit(0)  # no close: the job ends as a killed one does (gloo's teardown can abort, too)


if __name__ == "__main__":
    main()
