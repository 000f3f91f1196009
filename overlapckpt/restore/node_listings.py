"""Every node's local tier, listed and pooled: which versions are complete across the nodes, and what a node lacks.

Each rank lists its node's tier (``tier_listing``); the ranks gather the listings, and
``NodeListings`` answers what a restore asks of them (``restore/tiers.py`` chooses the
source): the newest version of this world size whose every file some node holds, on this
run's lineage first (``tier_lineage``: what the tier's ``latest`` names), and the copies
that bring each node the files its ranks read.
"""

from __future__ import annotations

import logging
import os
import stat
import warnings
from dataclasses import dataclass, field

from ..errors import CheckpointReadError, CorruptCheckpointError
from ..format.manifest import MANIFEST_NAME
from ..format.private_files import SMALL_FILE_MAX_BYTES
from ..format.tiers import tier_refusal, tier_store
from ..format.verify import read_manifest
from ..protocol import FileCopy

log = logging.getLogger("overlapckpt.restore")
# A node's tier, as listed: per committed checkpoint, (its version, its run, its files and their
# sizes, and the files its manifest says it has: their sizes, or -1 for the manifest itself).
Listing = dict[str, tuple[int, str, dict[str, int], dict[str, int]]]


def tier_listing(local_dir: str, world: int, root: str) -> Listing:
    """What this node's tier holds of checkpoints written at ``world`` ranks (those whose manifest reads).

    Its warnings' stacklevel (6) names the frame ``from_newest_tier``'s own warnings name (two above
    it), through ``local_candidate`` and ``_pooled_listings`` (``restore/tiers.py``).

    Nothing, with a warning naming why, when the directory is not this job's tier of ``root``
    (``format/tiers.py``: a symlink, another user's, writable by others, or another root's).
    Each file is ``lstat``ed on its own: only regular files count as held, so a dangling or
    planted link, a FIFO or an unreadable entry makes its checkpoint incomplete, not the restore fail.
    """
    refusal = tier_refusal(local_dir, root)
    if refusal is not None:
        warnings.warn(f"overlapckpt: the node-local tier {local_dir} is not read: {refusal}; restoring from the root {root}", stacklevel=6)
        return {}
    if not os.path.isdir(local_dir):
        return {}
    store = tier_store(local_dir)
    out: Listing = {}
    for name in store.committed_names():
        try:
            manifest = read_manifest(store, name)
        except (CorruptCheckpointError, CheckpointReadError) as e:
            warnings.warn(f"overlapckpt: the local tier's {store.checkpoint_url(name)} is skipped: {e}", stacklevel=6)
            continue
        if manifest.world_size != world or manifest.checksums is None:
            log.info(
                "the local tier's %s was written by %d ranks, and this run has %d (or it lists no files): not restored from "
                "the local tier; the root reshards", store.checkpoint_url(name), manifest.world_size, world,
            )
            continue
        needed = {file: record.nbytes for file, record in manifest.checksums.files.items()}
        needed[manifest.checksums.metadata_name] = manifest.checksums.metadata_nbytes
        needed[MANIFEST_NAME] = -1
        if needed[manifest.checksums.metadata_name] > SMALL_FILE_MAX_BYTES:
            warnings.warn(
                f"overlapckpt: the local tier's {store.checkpoint_url(name)} is skipped: its manifest gives .metadata "
                f"{needed[manifest.checksums.metadata_name]} bytes, above the {SMALL_FILE_MAX_BYTES} a .metadata may hold", stacklevel=6,
            )
            continue
        out[name] = (manifest.step, manifest.run_id or "", _regular_files(os.path.join(local_dir, name)), needed)
    return out


def _regular_files(directory: str) -> dict[str, int]:
    """The regular files of ``directory`` and their sizes; links, FIFOs and entries that cannot be ``lstat``ed are left out."""
    held: dict[str, int] = {}
    try:
        names = os.listdir(directory)
    except OSError as e:
        log.info("the local tier's %s cannot be listed (%s): taken as holding nothing", directory, e)
        return held
    for file in names:
        try:
            st = os.lstat(os.path.join(directory, file))
        except OSError as e:
            log.warning("the local tier's %s/%s cannot be read (%s): not counted as held", directory, file, e)
            continue
        if stat.S_ISREG(st.st_mode):
            held[file] = st.st_size
        else:
            log.warning("the local tier's %s/%s is not a regular file (a link, a FIFO or a device): not counted as held", directory, file)
    return held


def tier_lineage(local_dir: str) -> dict[str, int]:
    """The runs of the lineage the tier's ``latest`` names, each with the newest version of it on that lineage; {} if none.

    ``latest``'s run counts to any version, each ancestor to the version it was continued from:
    a rollback's abandoned branch (an ancestor's checkpoints newer than the fork) is not on it.
    """
    store = tier_store(local_dir)
    latest = store.read_latest()
    if latest is None:
        return {}
    try:
        manifest = read_manifest(store, latest)
    except (CorruptCheckpointError, CheckpointReadError) as e:
        log.info("the local tier's latest, %s, cannot be read (%s): versions are chosen without it", latest, e)
        return {}
    if manifest.run_id is None:
        return {}
    lineage = {manifest.run_id: _ANY_VERSION}
    for run_id, version in manifest.ancestors:
        lineage.setdefault(run_id, version)
    return lineage


_ANY_VERSION = 2**62


@dataclass
class NodeListings:
    """Every node's listing (by node key), and each node's lowest rank, which receives and sends for it.

    ``lineage``: the runs of the lineage the tiers' ``latest`` names (``tier_lineage``), empty when unknown.
    """

    listings: dict[str, Listing]
    leaders: dict[str, int]
    lineage: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_gathered(cls, nodes_by_rank: list[tuple[str, Listing]], lineage: dict[str, int] | None = None) -> NodeListings:
        leaders: dict[str, int] = {}
        for rank, (node, _) in enumerate(nodes_by_rank):
            leaders.setdefault(node, rank)
        return cls({node: nodes_by_rank[rank][1] for node, rank in leaders.items()}, leaders, dict(lineage or {}))

    def on_lineage(self, version: int, run_id: str) -> bool:
        """Whether ``run_id``'s checkpoint of ``version`` is on the lineage ``latest`` names (True when that is unknown)."""
        return not self.lineage or version <= self.lineage.get(run_id, -1)

    def newest_complete(self, step: int | None, root_version: int | None) -> tuple[str, int] | None:
        """(name, version) of the newest version whose every file some node holds, or None.

        As the root resolves a version: among equal versions, the one on the lineage ``latest``
        names wins; without a step, a checkpoint off that lineage (a branch a rollback
        abandoned) is never chosen. It is refused below the root's version, and where nodes
        hold different runs' under one name.
        """
        entries = sorted(
            {(entry[0], self.on_lineage(entry[0], entry[1]), entry[1], name) for listing in self.listings.values() for name, entry in listing.items()},
            reverse=True,
        )
        for version, on_lineage, run_id, name in entries:
            if step is not None and version != step:
                continue
            if step is None and not on_lineage:
                log.info("the local tier's %s is off the lineage its latest names (a rollback abandoned it): not restored", name)
                continue
            if step is None and root_version is not None and version < root_version:
                log.info(
                    "the root holds version %d, newer than the local tier's newest complete version %d: restoring from the root",
                    root_version, version,
                )
                return None
            holding = self._holding(name)
            if any(entry[:2] != (version, run_id) for entry in holding.values()):
                log.info("checkpoint %s is another run's on some node: not restored from the local tiers", name)
                continue
            lacking = [file for file, nbytes in self._needed(name).items() if not self._holders(name, file, nbytes)]
            if lacking:
                log.info("version %d in the local tiers lacks %s on every node: an older version is considered", version, lacking[0])
                continue
            return name, version
        return None

    def copies(self, name: str, wanted: dict[str, frozenset[str] | None]) -> list[FileCopy]:
        """The copies that give each node the files of ``name`` it wants (None: all), each from a node holding it.

        A file a node wants that is not one of the checkpoint's is refused: the name came from
        storage (a load plan read from .metadata), and only the manifest's files are copied.
        """
        needed = self._needed(name)
        copies: list[FileCopy] = []
        for node in sorted(self.listings, key=self.leaders.__getitem__):
            chosen = wanted.get(node)
            files = frozenset(needed) if chosen is None else chosen
            unknown = sorted(set(files) - needed.keys())
            if unknown:
                raise CorruptCheckpointError(f"the local tiers' checkpoint {name} is read from {unknown[:3]}, which its manifest does not list")
            held = self.listings[node].get(name, (0, "", {}, {}))[2]
            for k, file in enumerate(sorted(f for f in files if not self._holds(held, f, needed[f]))):
                holders = self._holders(name, file, needed[file])
                source = holders[k % len(holders)]  # spread over the nodes that hold it
                # The manifest's size, never the listing's: a listing is not signed. The manifest's own
                # file has no size in it: the holder's, which the small-file cap bounds.
                nbytes = needed[file] if needed[file] >= 0 else self._holding(name)[source][2][file]
                copies.append(FileCopy(self.leaders[source], self.leaders[node], file, nbytes))
        return copies

    def received(self, name: str, copies: list[FileCopy]) -> None:
        """Note the files a fetch gave each node."""
        by_leader = {rank: node for node, rank in self.leaders.items()}
        for copy in copies:
            listing = self.listings[by_leader[copy.target]]
            if name not in listing:
                version, run_id, _, needed = self._holding(name)[by_leader[copy.source]]
                listing[name] = (version, run_id, {}, needed)
            listing[name][2][copy.filename] = copy.nbytes

    def _holding(self, name: str) -> dict[str, tuple[int, str, dict[str, int], dict[str, int]]]:
        return {node: listing[name] for node, listing in self.listings.items() if name in listing}

    def _needed(self, name: str) -> dict[str, int]:
        return next(iter(self._holding(name).values()))[3]

    def _holders(self, name: str, file: str, nbytes: int) -> list[str]:
        return sorted((node for node, entry in self._holding(name).items() if self._holds(entry[2], file, nbytes)), key=self.leaders.__getitem__)

    @staticmethod
    def _holds(held: dict[str, int], file: str, nbytes: int) -> bool:
        if nbytes < 0:  # the manifest: read and checked on the node that listed it
            return file in held and held[file] <= SMALL_FILE_MAX_BYTES
        return file in held and held[file] == nbytes
