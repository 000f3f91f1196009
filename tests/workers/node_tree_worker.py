"""One rank of tests/test_node_tree.py: the writers' rounds through each node's leader, against the flat rounds.

    python tests/workers/node_tree_worker.py SCENARIO OUT_DIR   (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set)

Each layout (which node each rank is on) gets a gloo group of its own, as a writers'
generation does (a prefix of the store per layout, the group destroyed after), its
``NodeTree``, and the same values gathered and broadcast through the tree and flat.
Each rank writes what it saw to OUT_DIR/rank<R>.json.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository

from overlapckpt.format.peers import NodeLayout  # noqa: E402
from overlapckpt.writer.node_tree import NodeTree  # noqa: E402

from helpers import write_rank_result_and_leave  # noqa: E402

COORDINATOR = 0
TIMEOUT = timedelta(seconds=30)
# Longer than the test waits for the launch (180 s): a failure that reached a rank by timing out
# would end that rank too late, so the test sees only failures that arrived at once.
TIMEOUT_LONGER_THAN_THE_TEST = timedelta(seconds=600)


def _store(timeout: timedelta = TIMEOUT) -> dist.TCPStore:
    rank = int(os.environ["RANK"])
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=rank == 0, timeout=timeout)


def _join(store: dist.TCPStore, prefix: str, timeout: timedelta = TIMEOUT) -> None:
    dist.init_process_group(
        "gloo", store=dist.PrefixStore(prefix, store), rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout
    )


def _value(rank: int) -> Any:
    # Of a different size on each rank (gather_object exchanges sizes first), with a tensor in it.
    return {"rank": rank, "text": "x" * (100 * rank + 7), "tensor": torch.arange(rank + 3, dtype=torch.float64)}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def same(out: str) -> dict[str, Any]:
    """For each layout: the tree's gather and broadcast against the flat ones', bit for bit."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    layouts = [(0,) * world, tuple(range(world))]  # one node; a node per rank: no tree either way
    if world == 4:
        layouts += [(0, 0, 1, 1), (0, 1, 0, 1), (0, 0, 0, 1), (0, 1, 1, 1), (0, 1, 1, 2)]
    store = _store()
    seen: dict[str, Any] = {}
    for i, nodes in enumerate(layouts):
        _join(store, f"layout{i}/")
        layout = NodeLayout(nodes)
        entry: dict[str, Any] = {"wanted": NodeTree.pays_for(layout)}
        if entry["wanted"]:
            tree = NodeTree(layout, rank, TIMEOUT)
            flat: list[Any] | None = [None] * world if rank == COORDINATOR else None
            dist.gather_object(_value(rank), flat, dst=COORDINATOR)
            through_tree = tree.gather(_value(rank), world, COORDINATOR)
            entry["gather_same"] = _same(flat, through_tree)
            entry["gathered_ranks"] = None if through_tree is None else [v["rank"] for v in through_tree]
            box = [_value(7) if rank == COORDINATOR else None]
            dist.broadcast_object_list(box, src=COORDINATOR)
            entry["broadcast_same"] = _same(box[0], tree.broadcast(_value(7) if rank == COORDINATOR else None, COORDINATOR))
            entry["groups"] = [tree.node_group is not None, tree.leaders_group is not None]
        seen[",".join(map(str, nodes))] = entry
        dist.barrier()
        dist.destroy_process_group()
    _join(store, "leave/")  # write_rank_result_and_leave's barrier
    return {"layouts": seen}


def member_dies(out: str) -> dict[str, Any]:
    """Nodes (0, 0, 1, 1): rank 3 ends before the gather. Its leader (rank 2) and the coordinator raise; rank 1 is done."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = _store(TIMEOUT_LONGER_THAN_THE_TEST)
    _join(store, "dies/", TIMEOUT_LONGER_THAN_THE_TEST)
    tree = NodeTree(NodeLayout((0, 0, 1, 1)), rank, TIMEOUT_LONGER_THAN_THE_TEST)
    dist.barrier()
    result: dict[str, Any] = {}
    if rank == 3:
        _write(out, rank, {"ended": True})
        os._exit(0)
    try:
        gathered = tree.gather(_value(rank), world, COORDINATOR)
        result["gathered"] = None if gathered is None else len(gathered)
    except RuntimeError as e:
        result["error"] = str(e)
    _write(out, rank, result)
    os._exit(0)  # no barrier to leave by: rank 3 is gone


def _write(out: str, rank: int, result: dict[str, Any]) -> None:
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    sys.stdout.flush()


if __name__ == "__main__":
    scenario, out_dir = sys.argv[1], sys.argv[2]
    scenarios = {"same": same, "member_dies": member_dies}
    if scenario == "member_dies":
        member_dies(out_dir)
    write_rank_result_and_leave(os.path.join(out_dir, f"rank{os.environ['RANK']}.json"), lambda: scenarios[scenario](out_dir))
