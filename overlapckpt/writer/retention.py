"""Retention (``keep=N``) after a commit: this run's oldest checkpoints beyond N, uncommitted and out of the listing.

Runs in the writer process that committed (the coordinator, or a node's leader in the
local tier). Retention decides by each committed checkpoint's run id and version, read
from its manifest, at every commit. A manifest holds a record per tensor: at 30,000
tensors it is 9.9 MB and takes 0.5 s to parse, and every commit read all of them again
(3 with keep=2: 1.5 s of a commit's 9 s). The run id and version of a manifest are
therefore remembered by the manifest's content (its SHA-256 and length): a manifest read
or written before is not parsed again, and a file replaced under the same name is, since
its content differs.
"""

from __future__ import annotations

import hashlib

from .. import protocol as p
from ..format.manifest import MANIFEST_NAME, parse_manifest
from ..format.storage import CheckpointStore

Retired = list[tuple[CheckpointStore, str]]  # (store, directory) retention retired, to delete after the answer

# Manifests whose lineage is remembered; past this the memory starts afresh (a run keeps few).
LINEAGE_CACHE_ENTRIES = 1024

_ContentKey = tuple[int, bytes]  # (length, SHA-256) of a manifest's bytes
_lineage_by_content: dict[_ContentKey, tuple[str | None, int]] = {}


def _content_key(raw: bytes) -> _ContentKey:
    # A cryptographic hash: a file crafted to collide with a remembered one must not borrow its lineage.
    return (len(raw), hashlib.sha256(raw).digest())


def remember_lineage(raw: bytes, run_id: str | None, step: int) -> None:
    """Record the lineage of manifest bytes this writer just wrote (so the next commit's retention need not parse them)."""
    if len(_lineage_by_content) >= LINEAGE_CACHE_ENTRIES:
        _lineage_by_content.clear()
    _lineage_by_content[_content_key(raw)] = (run_id, step)


def _lineage(raw: bytes, where: str) -> tuple[str | None, int]:
    """(run id, version) of a manifest: remembered, or parsed (and checked) once. CorruptCheckpointError if damaged."""
    key = _content_key(raw)
    known = _lineage_by_content.get(key)
    if known is not None:
        return known
    manifest = parse_manifest(raw, where)
    remember_lineage(raw, manifest.run_id, manifest.step)
    return manifest.run_id, manifest.step


def select_for_retention(
    store: CheckpointStore,
    just_committed: str,
    run_id: str,
    keep: int,
    ancestors: tuple[tuple[str, int], ...] = (),
    retire_abandoned: bool = False,
) -> list[str]:
    """The lineage's oldest committed checkpoints beyond ``keep``, by version: the ones retention retires.

    The lineage is this run and the runs it descends from (``ancestors``: each with the
    version its descendant continued from): a restarted job's predecessors count as its own,
    so fifty restarts still hold at most ``keep + 1`` (the restore point survives until this
    run commits a newer one). An ancestor's checkpoints newer than the version continued
    from belong to a trajectory the lineage abandoned (a rollback, or a newer checkpoint that
    was refused): kept in the root, where a rollback loses nothing, and with
    ``retire_abandoned`` (the node-local tier: node memory) retired too. Checkpoints of other
    runs (another job, a branch this lineage never continued) are never deleted by it. The
    checkpoint just committed and the one ``latest`` names are never deleted.
    """
    protected = {just_committed, store.read_latest()}
    continued_up_to: dict[str, int] = {}
    for ancestor, version in ancestors:
        continued_up_to.setdefault(ancestor, version)
    mine: list[tuple[int, str]] = []
    abandoned: list[str] = []
    for name in store.committed_names():
        try:
            owner, step = _lineage(store.read_bytes(name, MANIFEST_NAME), store.checkpoint_url(name))
        except Exception:
            continue  # a damaged or unreadable manifest: not provably this lineage's, so kept
        if owner == run_id or (owner in continued_up_to and step <= continued_up_to[owner]):
            # By version, never by created_at: a wall clock that steps back (NTP, a VM
            # migration) must not make a newer checkpoint the oldest.
            mine.append((step, name))
        elif owner in continued_up_to and retire_abandoned:
            abandoned.append(name)
    mine.sort()
    retired = [name for _, name in mine[: max(0, len(mine) - keep)]] + abandoned
    return [name for name in retired if name not in protected]


def retire_old(
    store: CheckpointStore, req: p.PersistRequest, keep: int | None, purge_later: Retired, local_tier: bool = False
) -> tuple[list[str], list[str]]:
    """Retention's fast part, before the commit is answered: the oldest beyond ``keep`` uncommitted, out of the listing.

    (names retired, warnings). Their directories go to ``purge_later``: deleting them
    (unlinking hundreds of MiB each) took 0.3 s of a 768 MiB checkpoint's 1.4 s to
    durable when it ran before the answer. A failure is a warning: the checkpoint is
    committed all the same. ``local_tier``: ``keep`` is ``local_keep``, and the lineage's
    abandoned checkpoints go too (``select_for_retention``).
    """
    if keep is None:
        return [], []
    retired: list[str] = []
    try:
        for name in select_for_retention(store, req.name, req.run_id, keep, tuple(req.ancestors), retire_abandoned=local_tier):
            purge_later.append((store, store.retire_checkpoint(name, run_tag=req.run_id[:8])))
            retired.append(store.checkpoint_url(name))
    except Exception as e:
        setting = "local_keep" if local_tier else "keep"
        return retired, [f"checkpoint {req.name} committed in {store.root}, but retention ({setting}={keep}) failed: {type(e).__name__}: {e}"]
    return retired, []
