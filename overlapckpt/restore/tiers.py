"""Which tier a restore reads: the node-local tier's newest checkpoint, when it is the newest reachable.

``load(..., local_dir=...)`` and ``Checkpointer.restore()`` consider, in order, this
node's tier, then the partners' replicas on other nodes, then the root. Across nodes
the ranks pool every node's listing and take the newest version of this world size
whose every file some node holds, when it is at least as new as the root's; a node
that lacks files (it was replaced, its tmpfs gone) gets them from a node that holds
them, through the writers (``writer/replicas.py``, ``Checkpointer.restore()`` only).
The load then verifies it as any load does, and a refused one (a corrupt replica, a
missing file) falls back to the root with a warning naming it. Every choice, and why,
is logged.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

from ..errors import CheckpointNotFoundError, CheckpointReadError, CorruptCheckpointError, OverlapCkptError
from ..format.manifest import MANIFEST_NAME
from ..format.peers import node_key
from ..format.storage import CheckpointStore
from ..format.verify import read_manifest
from ..protocol import FileCopy
from .locate import checkpoint_at, resolve_checkpoint

log = logging.getLogger("overlapckpt.restore")
# What makes a local-tier checkpoint unusable, so the next source is tried.
FALLBACK_ERRORS = (CorruptCheckpointError, CheckpointReadError, CheckpointNotFoundError)
Read = TypeVar("Read")


# At a restore through a Checkpointer: its writers copy files between nodes' tiers
# (``writer/replicas.py``), given the checkpoint's name and the copies, on every rank at once.
Fetch = Callable[[str, tuple[FileCopy, ...]], None]


def from_newest_tier(
    path: str,
    local_dir: str | None,
    step: int | None,
    storage_options: dict[str, Any] | None,
    group: Any,
    world: int,
    read: Callable[[str, bool], Read],
    fetch: Fetch | None = None,
) -> Read:
    """``read(source, is_root)`` from the local tier's checkpoint when it is the one to restore, else from ``path``.

    A local-tier read that is refused (corrupt, missing, unreadable) is warned of, naming
    the checkpoint, and the root is read instead. The source and its time are logged.
    """
    if local_dir is not None:
        started = time.perf_counter()
        candidate = local_candidate(os.fspath(local_dir), path, step, storage_options, group, world, fetch)
        if candidate is not None:
            chosen_s = time.perf_counter() - started
            started = time.perf_counter()
            try:
                result = read(candidate, False)
            except FALLBACK_ERRORS as e:
                warnings.warn(
                    f"overlapckpt: the local tier's {candidate} was refused ({type(e).__name__}: {e}); restoring from the root {path}",
                    stacklevel=3,
                )
            else:
                log.info(
                    "restored from the local tier's %s in %.3f s (choosing it and fetching any replica took %.3f s)",
                    candidate, time.perf_counter() - started, chosen_s,
                )
                return result
    started = time.perf_counter()
    result = read(path, True)
    if local_dir is not None:
        log.info("restored from the root %s in %.3f s", path, time.perf_counter() - started)
    return result


def local_candidate(
    local_dir: str, path: str, step: int | None, storage_options: dict[str, Any] | None, group: Any, world: int, fetch: Fetch | None = None
) -> str | None:
    """The local-tier checkpoint directory to restore, or None (the root's is then read); every rank gets the same answer.

    In a distributed run the ranks pool what each node's tier holds, and take the newest
    version whose every file is on some node (its own, or as a partner's replica). A node
    that lacks some of them gets them through ``fetch`` (the writers); without it (``load``
    called outside a Checkpointer) the root is read.
    """
    if group is None:
        mine = _local_on_this_rank(local_dir, path, step, storage_options, world)
        return mine[0] if mine is not None else None
    import torch.distributed as dist

    root_version = _root_version(path, storage_options) if step is None and dist.get_rank(group) == 0 else None
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (node_key(), tier_listing(local_dir, world), root_version), group=group)
    choice = choose_version([(key, listing) for key, listing, _ in gathered], step, gathered[0][2])
    if choice is None:
        log.info("the local tiers hold no complete checkpoint to restore%s: restoring from the root %s", "" if step is None else f" of step {step}", path)
        return None
    name, version, copies = choice
    if copies:
        if fetch is None:
            log.info(
                "version %d is in the local tiers, but some node lacks %d of its files, and load() outside a Checkpointer cannot "
                "fetch them from a partner (Checkpointer.restore() can): restoring from the root %s", version, len(copies), path,
            )
            return None
        started = time.perf_counter()
        try:
            fetch(name, tuple(copies))
        except OverlapCkptError as e:
            warnings.warn(f"overlapckpt: fetching {name}'s replicas from partner nodes failed ({e}); restoring from the root {path}", stacklevel=4)
            return None
        log.info(
            "fetched %d files (%d bytes) of %s from partner nodes in %.3f s",
            len(copies), sum(c.nbytes for c in copies), name, time.perf_counter() - started,
        )
    where = CheckpointStore(local_dir).checkpoint_url(name)
    log.info("restoring version %d from the local tier: %s", version, where)
    return where


# A node's tier, as listed: per committed checkpoint, (its version, its run, its files and their
# sizes, and the files its manifest says it has: their sizes, or -1 for the manifest itself).
Listing = dict[str, tuple[int, str, dict[str, int], dict[str, int]]]


def tier_listing(local_dir: str, world: int) -> Listing:
    """What this node's tier holds of checkpoints written at ``world`` ranks (those whose manifest reads)."""
    if not os.path.isdir(local_dir):
        return {}
    store = CheckpointStore(local_dir)
    out: Listing = {}
    for name in store.committed_names():
        try:
            manifest = read_manifest(store, name)
        except (CorruptCheckpointError, CheckpointReadError) as e:
            warnings.warn(f"overlapckpt: the local tier's {store.checkpoint_url(name)} is skipped: {e}", stacklevel=5)
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
        directory = os.path.join(local_dir, name)
        held = {file: os.path.getsize(os.path.join(directory, file)) for file in os.listdir(directory)}
        out[name] = (manifest.step, manifest.run_id or "", held, needed)
    return out


def choose_version(nodes_by_rank: list[tuple[str, Listing]], step: int | None, root_version: int | None) -> tuple[str, int, list[FileCopy]] | None:
    """(name, version, the copies that complete every node's directory) of the newest complete version, or None.

    ``nodes_by_rank``: each rank's (node, listing). A version counts when every file its
    manifest names is on some node at its size; it is refused below the root's version.
    """
    leaders: dict[str, int] = {}
    for rank, (node, _) in enumerate(nodes_by_rank):
        leaders.setdefault(node, rank)
    listings = {node: nodes_by_rank[rank][1] for node, rank in leaders.items()}
    entries = sorted(
        {(entry[0], entry[1], name) for listing in listings.values() for name, entry in listing.items()}, reverse=True
    )
    for version, run_id, name in entries:
        if step is not None and version != step:
            continue
        if step is None and root_version is not None and version < root_version:
            log.info("the root holds version %d, newer than the local tiers' %d: restoring from the root", root_version, version)
            return None
        copies = _copies_completing(name, version, run_id, listings, leaders)
        if copies is not None:
            return name, version, copies
    return None


def _copies_completing(
    name: str, version: int, run_id: str, listings: dict[str, Listing], leaders: dict[str, int]
) -> list[FileCopy] | None:
    """The copies that give every node all of ``name``'s files, or None where a file is on no node (or a node holds another run's)."""
    holding = {node: listing[name] for node, listing in listings.items() if name in listing}
    if any(entry[:2] != (version, run_id) for entry in holding.values()):
        log.info("checkpoint %s is another run's on some node: not restored from the local tiers", name)
        return None
    needed = next(iter(holding.values()))[3]
    copies: list[FileCopy] = []
    for file, nbytes in sorted(needed.items()):
        holders = [node for node, entry in holding.items() if file in entry[2] and (nbytes < 0 or entry[2][file] == nbytes)]
        if not holders:
            log.info("version %d in the local tiers lacks %s on every node: an older version is considered", version, file)
            return None
        size = holding[holders[0]][2][file]
        for k, node in enumerate(n for n in sorted(listings, key=leaders.__getitem__) if n not in holders):
            source = leaders[holders[k % len(holders)]]
            copies.append(FileCopy(source, leaders[node], file, size))
    return copies


def _local_on_this_rank(
    local_dir: str, path: str, step: int | None, storage_options: dict[str, Any] | None, world: int
) -> tuple[str, int] | None:
    """(directory, version) of this node's local-tier checkpoint to restore, or None, with why logged."""
    if not os.path.isdir(local_dir):
        log.info("no local tier at %s: restoring from the root %s", local_dir, path)
        return None
    local = CheckpointStore(local_dir)
    try:
        name = resolve_checkpoint(local, step)
        manifest = read_manifest(local, name)
    except CheckpointNotFoundError:
        log.info("the local tier %s holds no checkpoint%s: restoring from the root", local_dir, "" if step is None else f" of step {step}")
        return None
    except (CorruptCheckpointError, CheckpointReadError) as e:
        warnings.warn(f"overlapckpt: the local tier {local_dir} cannot be restored from ({e}); restoring from the root {path}", stacklevel=4)
        return None
    where = local.checkpoint_url(name)
    if manifest.world_size != world:
        log.info(
            "the local tier's %s was written by %d ranks, and this run has %d: restoring from the root %s, which reshards",
            where, manifest.world_size, world, path,
        )
        return None
    if step is None:
        root_version = _root_version(path, storage_options)
        if root_version is not None and root_version > manifest.step:
            log.info("the root holds version %d, newer than the local tier's %d (%s): restoring from the root", root_version, manifest.step, where)
            return None
    log.info("restoring version %d from the local tier: %s", manifest.step, where)
    return where, manifest.step


def _root_version(path: str, storage_options: dict[str, Any] | None) -> int | None:
    """The version the root's newest checkpoint holds, None if it has none or cannot be read (the local tier is then used)."""
    try:
        store, name = checkpoint_at(path, None, storage_options)
        return read_manifest(store, name).step
    except CheckpointNotFoundError:
        return None
    except (CheckpointReadError, CorruptCheckpointError) as e:
        warnings.warn(f"overlapckpt: the root {path} cannot be read ({e}); restoring from the local tier", stacklevel=5)
        return None
