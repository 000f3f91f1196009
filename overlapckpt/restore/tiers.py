"""Which tier a restore reads: the node-local tier's newest checkpoint, when it is the newest reachable.

``load(..., local_dir=...)`` and ``Checkpointer.restore()`` consider, in order, this
node's tier, then the root (peer replicas are not written yet). The local tier is
chosen when its checkpoint is at least as new as the root's, was written at this world
size, and every rank found the same version there; the load then verifies it as any
load does, and a refused one (a corrupt or missing file) falls back to the root with a
warning naming it. Every choice, and why, is logged.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

from ..errors import CheckpointNotFoundError, CheckpointReadError, CorruptCheckpointError
from ..format.storage import CheckpointStore
from ..format.verify import read_manifest
from .locate import checkpoint_at, resolve_checkpoint

log = logging.getLogger("overlapckpt.restore")
# What makes a local-tier checkpoint unusable, so the next source is tried.
FALLBACK_ERRORS = (CorruptCheckpointError, CheckpointReadError, CheckpointNotFoundError)
Read = TypeVar("Read")


def from_newest_tier(
    path: str,
    local_dir: str | None,
    step: int | None,
    storage_options: dict[str, Any] | None,
    group: Any,
    world: int,
    read: Callable[[str, bool], Read],
) -> Read:
    """``read(source, is_root)`` from the local tier's checkpoint when it is the one to restore, else from ``path``.

    A local-tier read that is refused (corrupt, missing, unreadable) is warned of, naming
    the checkpoint, and the root is read instead. The source and its time are logged.
    """
    if local_dir is not None:
        candidate = local_candidate(os.fspath(local_dir), path, step, storage_options, group, world)
        if candidate is not None:
            started = time.perf_counter()
            try:
                result = read(candidate, False)
            except FALLBACK_ERRORS as e:
                warnings.warn(
                    f"overlapckpt: the local tier's {candidate} was refused ({type(e).__name__}: {e}); restoring from the root {path}",
                    stacklevel=3,
                )
            else:
                log.info("restored from the local tier's %s in %.3f s", candidate, time.perf_counter() - started)
                return result
    started = time.perf_counter()
    result = read(path, True)
    if local_dir is not None:
        log.info("restored from the root %s in %.3f s", path, time.perf_counter() - started)
    return result


def local_candidate(local_dir: str, path: str, step: int | None, storage_options: dict[str, Any] | None, group: Any, world: int) -> str | None:
    """The local-tier checkpoint directory to restore, or None (the root's is then read); every rank gets the same answer."""
    mine = _local_on_this_rank(local_dir, path, step, storage_options, world)
    if group is None:
        return mine[0] if mine is not None else None
    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, None if mine is None else mine[1], group=group)
    if mine is None or any(version != mine[1] for version in gathered):
        if mine is not None:
            log.info("not restoring from the local tier %s: its newest version differs across ranks (%s)", local_dir, gathered)
        return None
    return mine[0]


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
