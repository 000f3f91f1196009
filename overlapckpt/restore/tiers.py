"""Which tier a restore reads: the node-local tier's newest checkpoint, when it is the newest reachable.

``load(..., local_dir=...)`` and ``Checkpointer.restore()`` consider, in order, this
node's tier, then the partners' replicas on other nodes, then the root. Across nodes
the ranks pool every node's digest of its tier (``restore/node_listings.py``: per
checkpoint, its manifest's SHA-256 and which files the node holds, never their
names) and take the newest version of this world size whose every file some node holds,
when it is at least as new as the root's. A node
that lacks files its ranks read (it was replaced, its tmpfs gone; or, on more than two
nodes, it holds only its own and its partners' shards) gets them from a node that holds
them, through the writers (``writer/replicas.py``, ``Checkpointer.restore()`` only):
``.metadata`` and the manifest first, then the files each rank's DCP load plan names
(``plan.py``), never the whole checkpoint where the ranks read part of it. Each rank reads
the file names from its node's own copy of the manifest, once the nodes agree on it by its
SHA-256, and the ranks gather only what each node lacks: no file list crosses the network.
The load then verifies what it reads as any load does, and a refused one (a corrupt
replica, a missing file) falls back to the root with a warning naming it. Every choice,
and why, is logged.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from ..errors import CheckpointMismatchError, CheckpointNotFoundError, CheckpointReadError, CorruptCheckpointError, OverlapCkptError
from ..format.manifest import MANIFEST_NAME, METADATA_NAME
from ..format.peers import node_key
from ..format.storage import CheckpointStore
from ..format.verify import read_manifest
from ..protocol import FileCopy
from .locate import checkpoint_at
from .node_listings import FileTable, NodeListings, agreed_file_table, tier_lineage, tier_listing

log = logging.getLogger("overlapckpt.restore")
# What makes a local-tier checkpoint unusable, so the next source is tried. A mismatch too:
# a tier another job left at this name (other shapes) must not stop a restart the root can serve.
FALLBACK_ERRORS = (CorruptCheckpointError, CheckpointReadError, CheckpointNotFoundError, CheckpointMismatchError)
Read = TypeVar("Read")
# The files every rank's restore reads, whatever its share: DCP's .metadata and the manifest.
HEAD_FILES = frozenset({MANIFEST_NAME, METADATA_NAME})


@dataclass(frozen=True)
class Source:
    """Where a restore reads: the root, or one local-tier checkpoint directory."""

    url: str
    is_root: bool
    # Of a local-tier directory: the files this rank's load reads from it (its node holds
    # them; a node's directory holds only what its ranks read), so the checks before the read
    # cover these. None: every rank checks its 1/N share of all the files.
    files: frozenset[str] | None = None


@dataclass
class RestoreReport:
    """Where a restore read from, and what each part took (also logged): for the figures callback.

    A Checkpointer hands ``figures()`` to ``on_commit`` with the first commit after its
    restore (``Checkpointer.restore_figures`` holds them at once).
    """

    source: str = "root"  # "local tier", "partner replicas" (the local tier, some files fetched first) or "root"
    choose_s: float = 0.0  # listing every node's tier, agreeing on a version, and the fetch
    fetch_s: float = 0.0  # of which: the writers' copies between nodes
    fetched_files: int = 0
    fetched_bytes: int = 0
    read_s: float = 0.0  # the load from the source it came from
    refused_local_read_s: float | None = None  # a local-tier read that was refused before the root was read

    def figures(self, step: int) -> dict[str, Any]:
        """Flat, units in the names, as a commit's figures are."""
        return {
            "restore_source": self.source,
            "restore_step": step,
            "restore_s": self.choose_s + self.read_s + (self.refused_local_read_s or 0.0),
            "restore_choose_s": self.choose_s,
            "restore_fetch_s": self.fetch_s,
            "restore_fetched_files": self.fetched_files,
            "restore_fetched_bytes": self.fetched_bytes,
            "restore_read_s": self.read_s,
            "restore_refused_local_read_s": self.refused_local_read_s,
        }


# At a restore through a Checkpointer: its writers copy files between nodes' tiers
# (``writer/replicas.py``), given the checkpoint's name and the copies, on every rank at once.
Fetch = Callable[[str, tuple[FileCopy, ...]], None]
# The files of a local-tier checkpoint directory (its URL) that this rank's load reads: its
# DCP load plan's (restore/plan.py). It reads .metadata, so it is called once the directory has it.
FilesRead = Callable[[str], frozenset[str]]


@dataclass(frozen=True)
class RestoreScope:
    """What a restore chooses among the tiers for, and which ranks choose it together (``from_newest_tier``'s arguments).

    Every rank of ``group`` gets the same answer; ``group=None``: one process chooses alone.
    """

    path: str  # the root, or one checkpoint directory of it
    step: int | None = None  # None: the newest committed version
    storage_options: dict[str, Any] | None = None  # the root's fsspec options
    group: Any = None  # the ranks that choose together (torch.distributed); None: one process
    world: int = 1  # the world size the restore loads at: a local-tier checkpoint of another is not chosen


def from_newest_tier(
    scope: RestoreScope,
    local_dir: str | os.PathLike[str] | None,
    read: Callable[[Source], Read],
    fetch: Fetch | None = None,
    files_read: FilesRead | None = None,
    report: RestoreReport | None = None,
) -> Read:
    """``read(source)`` from the local tier's checkpoint when it is the one to restore, else from the root ``scope.path``.

    A local-tier read that is refused (corrupt, missing, unreadable) is warned of, naming
    the checkpoint, and the root is read instead. The source and its time are logged.
    ``files_read``: what each rank's load reads, so that a node is fetched only those files;
    without it (a reader of whole checkpoints), every node is completed. ``report``: filled
    with the source and the time each part took.
    """
    path = scope.path
    report = report if report is not None else RestoreReport()
    if local_dir is not None:
        started = time.perf_counter()
        candidate = local_candidate(scope, os.fspath(local_dir), fetch, files_read, report)
        report.choose_s = chosen_s = time.perf_counter() - started
        if candidate is not None:
            started = time.perf_counter()
            try:
                result = read(candidate)
            except FALLBACK_ERRORS as e:
                report.refused_local_read_s = time.perf_counter() - started
                warnings.warn(
                    f"overlapckpt: the local tier's {candidate.url} was refused ({type(e).__name__}: {e}); restoring from the root {path}",
                    stacklevel=3,
                )
            else:
                report.read_s = time.perf_counter() - started
                report.source = "partner replicas" if report.fetched_files else "local tier"
                log.info(
                    "restored from the local tier's %s in %.3f s (choosing it and fetching any replica took %.3f s)",
                    candidate.url, report.read_s, chosen_s,
                )
                return result
    started = time.perf_counter()
    result = read(Source(path, is_root=True))
    report.source, report.read_s = "root", time.perf_counter() - started
    if local_dir is not None:
        log.info("restored from the root %s in %.3f s", path, report.read_s)
    return result


def local_candidate(
    scope: RestoreScope,
    local_dir: str,
    fetch: Fetch | None = None,
    files_read: FilesRead | None = None,
    report: RestoreReport | None = None,
) -> Source | None:
    """The local-tier checkpoint directory to restore, or None (the root's is then read); every rank gets the same answer.

    The ranks pool what each node's tier holds (one process: its own tier, the same way), and
    take the newest version whose every file is on some node (its own, or as a partner's
    replica), skipping a checkpoint whose manifest is unreadable with a warning. A node
    that lacks a file one of its ranks reads gets it through ``fetch`` (the writers): first
    ``.metadata`` and the manifest, then, with ``files_read``, the files the ranks' load
    plans name (else every file). Without ``fetch`` (``load`` called outside a
    Checkpointer) the root is read instead.
    """
    path, step, group = scope.path, scope.step, scope.group
    if not os.path.isdir(local_dir):
        log.info("no local tier at %s on this node", local_dir)
    tiers, root_version = _pooled_listings(scope, local_dir)
    choice = tiers.newest_complete(step, root_version)
    if choice is None:
        log.info("the local tiers hold no complete checkpoint to restore%s: restoring from the root %s", "" if step is None else f" of step {step}", path)
        return None
    name, version = choice
    where = CheckpointStore(local_dir).checkpoint_url(name)
    # One process reads every file: its own tier holds them all (it was chosen as complete, and
    # no other node could hold one). Many processes that read whole checkpoints: so may every node.
    if group is None or (files_read is None and not tiers.missing(name)):
        log.info("restoring version %d from the local tier: %s", version, where)
        return Source(where, is_root=False)
    if fetch is None and files_read is None:
        _say_unfetchable(version, tiers.missing(name), path)
        return None
    # .metadata and the manifest first: each rank reads the file table from the manifest, and its
    # load plan from .metadata.
    if not _fetched(tiers, name, version, lambda: tiers.head_copies(name), fetch, path, report):
        return None
    reads, table, plans = _gathered_lacking(tiers, name, local_dir, where, files_read, group)
    failed = [(rank, why) for rank, (_, _, why, _) in enumerate(plans) if why is not None]
    if failed or table is None:  # this rank without its table sent its failure: failed names it
        rank, why = failed[0]
        warnings.warn(f"overlapckpt: the local tier's {where} cannot be planned on rank {rank} ({why}); restoring from the root {path}", stacklevel=4)
        return None
    agreed: FileTable = table  # every rank's: the same manifest, by its SHA-256
    refused = [refusal for _, _, _, refusal in plans if refusal is not None]
    wanted: dict[str, frozenset[int]] = {}
    for key, lacking, _, _ in plans:
        wanted[key] = frozenset(lacking) | wanted.get(key, frozenset())

    def copies() -> list[FileCopy]:
        if refused:  # a name a load plan gave that the manifest lacks, on some rank: every rank refuses alike
            raise CorruptCheckpointError(refused[0])
        return tiers.copies(name, agreed, wanted)

    if not _fetched(tiers, name, version, copies, fetch, path, report, agreed):
        return None
    if reads is None:
        log.info("restoring version %d from the local tier: %s", version, where)
    else:
        log.info("restoring version %d from the local tier: %s (this rank reads %d of its files)", version, where, len(reads))
    return Source(where, is_root=False, files=reads)


def _pooled_listings(scope: RestoreScope, local_dir: str) -> tuple[NodeListings, int | None]:
    """Every node's local-tier listing, pooled on every rank, and the root's newest version (None: none, or a step was named)."""
    path, step, storage_options, group, world = scope.path, scope.step, scope.storage_options, scope.group, scope.world
    if group is None:
        root_version = _root_version(path, storage_options) if step is None else None
        listing = tier_listing(local_dir, world, path)
        tiers = NodeListings.from_gathered([(node_key(), listing)], lineage=tier_lineage(local_dir) if listing else {})
        return tiers, root_version
    import torch.distributed as dist

    rank = dist.get_rank(group)
    root_version = _root_version(path, storage_options) if step is None and rank == 0 else None
    keys: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(keys, (node_key(), root_version), group=group)
    # Only each node's lowest rank lists its tier: the others' digests would be the same, and every
    # rank receives every node's (a digest per checkpoint: its size grows with the files by a bit each).
    leads = [key for key, _ in keys].index(keys[rank][0]) == rank
    listings: list[Any] = [None] * len(keys)
    listing = tier_listing(local_dir, world, path) if leads else {}
    dist.all_gather_object(listings, (listing, tier_lineage(local_dir) if listing else {}), group=group)
    lineage: dict[str, int] = {}
    for _, of_node in listings:  # every node's tier names the same latest, or one an older commit left
        lineage = lineage or of_node
    tiers = NodeListings.from_gathered([(key, of_node) for (key, _), (of_node, _) in zip(keys, listings)], lineage=lineage)
    return tiers, keys[0][1]


def _gathered_lacking(
    tiers: NodeListings, name: str, local_dir: str, where: str, files_read: FilesRead | None, group: Any
) -> tuple[frozenset[str] | None, FileTable | None, list[Any]]:
    """What this rank's load reads of ``name`` (None: every file), its node's file table, and every rank's (node, lacking, failure, refusal).

    Each rank reads the file table from its node's copy of the manifest (the head fetch gave every
    node one) and sends only the bit indices of the files it reads that its node lacks: on a node
    that holds its ranks' files, nothing. Without ``files_read`` each node's lowest rank sends every
    file its node lacks. ``failure``: the table or the plan could not be had (the root is read);
    ``refusal``: a file the plan names that the manifest does not list (CorruptCheckpointError's message).
    """
    import torch.distributed as dist

    node, rank = node_key(), dist.get_rank(group)
    reads: frozenset[str] | None = None
    table: FileTable | None = None
    lacking: tuple[int, ...] = ()
    failure: str | None = None
    refusal: str | None = None
    try:
        table = agreed_file_table(local_dir, name, tiers.digest(name))
        if files_read is not None:
            reads = HEAD_FILES | files_read(where)
    except Exception as e:  # noqa: BLE001 - gathered below and agreed on by every rank, which then reads the root
        failure = f"{type(e).__name__}: {e}"
    if table is not None and failure is None:
        try:
            if reads is not None:
                lacking = tiers.lacking(node, name, table.indices(name, reads))
            elif tiers.leaders[node] == rank:
                lacking = tiers.lacking(node, name, range(len(table.names)))
        except CorruptCheckpointError as e:
            refusal = str(e)
    plans: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(plans, (node, lacking, failure, refusal), group=group)
    return reads, table, plans


def _fetched(
    tiers: NodeListings,
    name: str,
    version: int,
    planned: Callable[[], Sequence[FileCopy]],
    fetch: Fetch | None,
    path: str,
    report: RestoreReport | None,
    table: FileTable | None = None,
) -> bool:
    """Whether every node holds the files of ``name`` it wants, fetching the ``planned`` copies; False: read the root.

    ``table``: this node's file table, to note what was fetched (None: the head fetch).
    """
    try:
        copies = list(planned())
    except CorruptCheckpointError as e:  # the same on every rank: each computes the copies from what all gathered
        warnings.warn(f"overlapckpt: {e}; restoring from the root {path}", stacklevel=5)
        return False
    if not copies:
        return True
    if fetch is None:
        _say_unfetchable(version, len(copies), path)
        return False
    started = time.perf_counter()
    try:
        fetch(name, tuple(copies))
    except OverlapCkptError as e:
        warnings.warn(f"overlapckpt: fetching {name}'s replicas from partner nodes failed ({e}); restoring from the root {path}", stacklevel=5)
        return False
    tiers.received(name, copies, table)
    fetch_s, nbytes = time.perf_counter() - started, sum(c.nbytes for c in copies)
    if report is not None:
        report.fetch_s += fetch_s
        report.fetched_files += len(copies)
        report.fetched_bytes += nbytes
    log.info("fetched %d files (%d bytes) of %s from partner nodes in %.3f s", len(copies), nbytes, name, fetch_s)
    return True


def _say_unfetchable(version: int, files: int, path: str) -> None:
    log.info(
        "version %d is in the local tiers, but some node lacks %d of the files its ranks read, and load() outside a "
        "Checkpointer cannot fetch them from a partner (Checkpointer.restore() can): restoring from the root %s",
        version, files, path,
    )


def _root_version(path: str, storage_options: dict[str, Any] | None) -> int | None:
    """The version the root's newest checkpoint holds, None if it has none or cannot be read (the local tier is then used)."""
    try:
        store, name = checkpoint_at(path, None, storage_options)
        return read_manifest(store, name).step
    except CheckpointNotFoundError:
        return None
    except (CheckpointReadError, CorruptCheckpointError) as e:
        # stacklevel: the frame from_newest_tier's own warnings name (two above it), through local_candidate
        # and _pooled_listings.
        warnings.warn(f"overlapckpt: the root {path} cannot be read ({e}); restoring from the local tier", stacklevel=6)
        return None
