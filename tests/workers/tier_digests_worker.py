"""One rank of a two-"node" restore choice for tests/test_tiers.py: what the ranks gather, and the copies they agree on.

    python tests/workers/tier_digests_worker.py SCENARIO OUT_DIR   (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set)

Each rank is a node of its own (``restore/tiers.py``'s ``node_key`` answers ``node-<rank>``)
with a tier of its own under OUT_DIR, so the choice runs as on two nodes without namespaces
(``tests/test_tier_nodes.py`` runs the real ones). The fetch is the writers' stand-in: the target
rank copies each file from the source rank's tier, then every rank passes a barrier.
Each rank writes what it sent and saw to OUT_DIR/rank<R>.json.
"""

from __future__ import annotations

import os
import pickle
import shutil
import sys
import warnings
from datetime import timedelta
from typing import Any

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers, fake_tiers
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository

from fake_tiers import manifest_bytes, write_tier_checkpoint  # noqa: E402

import overlapckpt.restore.tiers as tiers_module  # noqa: E402
from overlapckpt.format.manifest import MANIFEST_NAME  # noqa: E402
from overlapckpt.format.tiers import prepare_tier  # noqa: E402
from overlapckpt.protocol import FileCopy  # noqa: E402
from overlapckpt.restore.tiers import RestoreScope, local_candidate  # noqa: E402

from helpers import write_rank_result_and_leave  # noqa: E402

FILES = {"__0_0.distcp": 100, "__1_0.distcp": 200}


def lacking(out: str, forge_manifest: bool = False) -> dict[str, Any]:
    """Node 0 holds the checkpoint; node 1 was replaced (its tier is empty). Each rank reads its own shard and rank 0's.

    ``forge_manifest``: the fetch gives node 1 another manifest of the same step, run and files
    (written at another time) instead of the one the nodes agreed on.
    """
    rank = dist.get_rank()
    tiers_module.node_key = lambda: f"node-{rank}"  # type: ignore[assignment] # each rank a node of its own
    root = os.path.join(out, "root")
    local = os.path.join(out, f"local{rank}")
    os.makedirs(root, exist_ok=True)
    if rank == 0:
        name = write_tier_checkpoint(local, root, 6, FILES, 2)
    else:
        prepare_tier(local, root)
    dist.barrier()
    sent: list[Any] = []
    gather = dist.all_gather_object

    def recording(objects: list[Any], obj: Any, group: Any = None) -> None:
        sent.append(obj)
        gather(objects, obj, group=group)

    dist.all_gather_object = recording  # type: ignore[assignment]
    fetched: list[FileCopy] = []

    def fetch(name: str, copies: tuple[FileCopy, ...]) -> None:
        for copy in copies:
            if copy.target == rank:
                target = os.path.join(out, f"local{copy.target}", name)
                os.makedirs(target, mode=0o700, exist_ok=True)
                shutil.copyfile(os.path.join(out, f"local{copy.source}", name, copy.filename), os.path.join(target, copy.filename))
                if forge_manifest and copy.filename == MANIFEST_NAME:
                    with open(os.path.join(target, copy.filename), "wb") as f:
                        f.write(manifest_bytes(6, "0123456789abcdef" * 2, FILES, 2, created_at=1.0))
        fetched.extend(copies)
        dist.barrier()  # as the writers' copies are one collective: every file is in before any rank goes on

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        source = local_candidate(
            RestoreScope(root, None, None, group=dist.group.WORLD, world=2), local, fetch,
            lambda where: frozenset({f"__{rank}_0.distcp", "__0_0.distcp"}),
        )
    dist.all_gather_object = gather  # type: ignore[assignment]
    if forge_manifest:
        return {
            "rank": rank, "source": None if source is None else source.url, "warnings": [str(w.message) for w in caught],
            "copies": [[c.source, c.target, c.filename] for c in fetched],
        }
    assert source is not None and source.files is not None
    name = os.path.basename(source.url)
    listing = pickle.dumps(sent[1])  # (node key, root version), then the listings, then what each rank lacks
    return {
        "rank": rank,
        "sent": list(sent[2][:1]) + [list(sent[2][1])] + list(sent[2][2:]),
        "copies": [[c.source, c.target, c.filename, c.nbytes] for c in fetched],
        "files": sorted(source.files),
        "manifest_nbytes": os.path.getsize(os.path.join(out, "local0", name, "overlapckpt.json")),
        "listing_names": [f for f in FILES if f.encode() in listing],
    }


SCENARIOS = {"lacking": lacking, "forged_manifest": lambda out: lacking(out, forge_manifest=True)}


def main() -> None:
    scenario, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    write_rank_result_and_leave(os.path.join(out, f"rank{dist.get_rank()}.json"), lambda: SCENARIOS[scenario](out))


if __name__ == "__main__":
    main()
