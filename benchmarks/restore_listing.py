"""What one node puts into the restore's listing gather, per checkpoint in its tier, as the checkpoint's files grow.

    python benchmarks/restore_listing.py [--ranks 8,256,1024,8192] [--out benchmarks/results/scale/restore_listing.txt]

At a restore every node's lowest rank lists its node-local tier and the ranks all-gather the
listings (``restore/tiers.py``: ``_pooled_listings``), so every rank receives every node's value
for every checkpoint the tiers keep. Per world size N (N + 2 files: one data file per rank, DCP's
names ``__<rank>_0.distcp``, plus ``.metadata`` and the manifest), this builds a tier checkpoint whose
node holds every file (``tests/fake_tiers.py``: a real manifest read back through
``read_manifest``; the files hold zeros), lists it with ``tier_listing``, and reports the
pickled bytes of that one checkpoint's value, as ``all_gather_object`` pickles it:

- **digest**: what ``tier_listing`` gathers now, a ``TierDigest`` (the manifest's SHA-256, the
  run, four integers, and the files held: one byte when every one is, else the shorter of a
  bitmap and the held indices, ``restore/held_files.py``);
- **names**: a listing that names every file instead (the version, the run, and every file's
  name and size twice: as held and as the manifest needs it), as ``tier_listing`` gathered it
  before digests, rebuilt here from the same manifest (pickled to the same bytes).

Each is measured for a node holding every file, and for node 0 of many holding its own 8 ranks'
shards, its partner node's (``local_replicas=1``) and the head files, as a node holds a
checkpoint of a job on many nodes. Counts, not times: the same on every machine and every run.
The projection assumes 8 ranks per node, one file per rank, and the tiers' default
``local_keep`` (2) checkpoints.
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests"))  # fake_tiers

from fake_tiers import write_tier_checkpoint  # noqa: E402

from overlapckpt.format.manifest import MANIFEST_NAME  # noqa: E402
from overlapckpt.format.tiers import tier_store  # noqa: E402
from overlapckpt.format.verify import read_manifest  # noqa: E402
from overlapckpt.restore.node_listings import tier_listing  # noqa: E402
from overlapckpt.settings import DEFAULT_LOCAL_KEEP  # noqa: E402

RANKS_PER_NODE = 8


def partner_node_files(ranks: int) -> set[str]:
    """The data files node 0 holds on many nodes: its ranks' shards and its partner node's (``local_replicas=1``)."""
    own = range(min(ranks, RANKS_PER_NODE))
    partner = range(RANKS_PER_NODE, min(ranks, 2 * RANKS_PER_NODE))
    return {f"__{rank}_0.distcp" for rank in [*own, *partner]}  # and the head files, which every tier checkpoint holds


def listed_bytes(ranks: int, scratch: str, held_files: set[str] | None) -> tuple[int, int]:
    """(digest, names): the pickled bytes of one checkpoint's value in the listing gather at ``ranks``, now and before digests.

    ``held_files``: what the node holds (None: every file).
    """
    tag = "all" if held_files is None else "partner"
    local, root = os.path.join(scratch, f"local-{ranks}-{tag}"), os.path.join(scratch, f"root-{ranks}-{tag}")
    os.makedirs(root)
    data = {f"__{rank}_0.distcp": 1 for rank in range(ranks)}
    name = write_tier_checkpoint(local, root, 6, data, ranks, held=held_files)
    listing = tier_listing(local, ranks, root)
    digest = len(pickle.dumps({name: listing[name]}))
    manifest = read_manifest(tier_store(local), name)
    sums = manifest.checksums
    needed = {**{f: r.nbytes for f, r in sums.files.items()}, sums.metadata_name: sums.metadata_nbytes, MANIFEST_NAME: -1}  # type: ignore[union-attr]
    held = {f: os.lstat(os.path.join(local, name, f)).st_size for f in os.listdir(os.path.join(local, name))}
    names = len(pickle.dumps({name: (manifest.step, manifest.run_id or "", held, needed)}))
    return digest, names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", default="8,256,1024,8192", help="world sizes, comma-separated: a checkpoint of N ranks has N + 2 files")
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "scale", "restore_listing.txt"))
    args = parser.parse_args()
    lines = [
        f"$ python benchmarks/restore_listing.py --ranks {args.ranks}",
        "",
        "pickled bytes of one checkpoint's value in the restore's listing gather: a node holding every file (all),",
        f"and a node of {RANKS_PER_NODE} ranks holding its shards and one partner node's (local_replicas=1) with the head files (partner);",
        f"per rank received: every node's partner value ({RANKS_PER_NODE} ranks per node, one file per rank) for {DEFAULT_LOCAL_KEEP} kept checkpoints",
        "",
        f"{'ranks':>8} {'files':>8} {'all: digest':>12} {'names':>10} {'partner: digest':>16} {'names':>10} {'per rank, digest':>18} {'per rank, names':>18}",
    ]
    with tempfile.TemporaryDirectory() as scratch:
        for ranks in (int(n) for n in args.ranks.split(",")):
            digest, names = listed_bytes(ranks, scratch, None)
            partner_digest, partner_names = listed_bytes(ranks, scratch, partner_node_files(ranks))
            nodes = max(1, ranks // RANKS_PER_NODE)
            lines.append(
                f"{ranks:>8} {ranks + 2:>8} {digest:>12} {names:>10} {partner_digest:>16} {partner_names:>10} "
                f"{partner_digest * nodes * DEFAULT_LOCAL_KEEP:>18,} {partner_names * nodes * DEFAULT_LOCAL_KEEP:>18,}"
            )
    text = "\n".join(lines) + "\n"
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    print(text, end="")


if __name__ == "__main__":
    main()
