"""Finding committed checkpoints: listing a root, resolving a step or ``latest``, telling a checkpoint directory from a root."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator
from typing import Any

from ..errors import (
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
)
from ..format.manifest import NAME_STYLES, CheckpointInfo, Manifest, checkpoint_name, step_of_name
from ..format.storage import CheckpointStore, translate_read_errors
from ..format.verify import read_manifest


def listable(store: CheckpointStore, names: Iterable[str]) -> Iterator[tuple[str, Manifest]]:
    """The committed checkpoints among ``names`` whose manifest reads and passes its checksum.

    The one rule behind both ``list_checkpoints`` and ``load(step=None)``: a committed
    checkpoint with a damaged manifest is skipped, with a warning. A storage failure
    (CheckpointReadError) is raised, never skipped: skipping it would make
    ``load(step=None)`` silently pick an older checkpoint.
    """
    for name in names:
        try:
            manifest = read_manifest(store, name)
        except CorruptCheckpointError as e:
            warnings.warn(f"overlapckpt: skipping {store.checkpoint_url(name)}: {e}", stacklevel=3)
            continue
        yield name, manifest


def _newest_of_lineage(store: CheckpointStore, names: list[str], latest: str, latest_manifest: Manifest) -> str:
    """The newest committed checkpoint of ``latest``'s run: ``latest`` lags after a crash between a commit and its update.

    A writer (or the whole job) killed after a checkpoint's commit and before ``latest``
    names it leaves ``latest`` one checkpoint behind; resuming from it would silently go
    back. Checkpoints of other runs (an abandoned trajectory after a rollback) are never
    chosen over ``latest``'s run.
    """
    version = latest_manifest.step
    newer = sorted((n for n in names if (step_of_name(n) or -1) > version), key=lambda n: step_of_name(n) or -1, reverse=True)
    for name, manifest in listable(store, newer):
        if manifest.run_id is not None and manifest.run_id == latest_manifest.run_id:
            warnings.warn(
                f"overlapckpt: {store.root}/latest names {latest} (version {version}), but its run also committed {name} "
                f"(version {manifest.step}), which a crash before latest's update left unnamed; loading {name}. "
                f"Pass step={version} to load the one latest names",
                stacklevel=4,
            )
            return name
    return latest


def list_checkpoints(path: str, storage_options: dict[str, Any] | None = None) -> list[CheckpointInfo]:
    """Committed checkpoints under ``path``, oldest first.

    Uncommitted directories never appear; a committed one whose manifest is damaged
    is skipped with a warning. CheckpointReadError if storage cannot be read.
    """
    store = CheckpointStore(path, storage_options)
    with translate_read_errors(store.root):
        names = store.committed_names()
    return [CheckpointInfo.from_manifest(m, store.checkpoint_url(n)) for n, m in listable(store, names)]


def resolve_checkpoint(store: CheckpointStore, step: int | None, skip_damaged: bool = True) -> str:
    """The directory name of the requested committed checkpoint.

    ``step=None`` picks the checkpoint ``latest`` names, else the newest, among those
    ``list_checkpoints`` lists (a damaged manifest is skipped; with ``skip_damaged=False``,
    as ``verify`` wants, among all committed ones). A given ``step`` is returned if
    committed; reading its manifest then raises if it is damaged.
    """
    with translate_read_errors(store.root):
        names = store.committed_names()
    if not names:
        raise CheckpointNotFoundError(
            f"no committed checkpoint under {store.root!r}; check the path, or wait for a checkpoint to commit "
            "(a directory counts once its .metadata exists)"
        )
    if step is None:
        with translate_read_errors(store.root):
            latest = store.read_latest()
        # Newest first, stopping at the first readable one: the manifests of older
        # checkpoints need not be read.
        preferred = ([latest] if latest in names else []) + [n for n in reversed(names) if n != latest]
        if not skip_damaged:
            return preferred[0]
        for name, manifest in listable(store, preferred):
            if name == latest:
                return _newest_of_lineage(store, names, name, manifest)
            return name
        raise CheckpointNotFoundError(
            f"every committed checkpoint under {store.root!r} has a damaged manifest ({len(names)} of them); "
            "see the warnings, and run `overlapckpt verify --all` on it"
        )
    matching = [n for n in names if step_of_name(n) == step]
    if not matching:
        steps = [step_of_name(n) for n in names]
        raise CheckpointNotFoundError(
            f"no committed checkpoint of step {step} under {store.root!r}; committed steps are {steps}"
        )
    if len(matching) == 1:
        return matching[0]
    # Two runs' checkpoints of one version (the second has a lineage-aware name, after a
    # rollback): the one of latest's run, else the plain name, which the first run wrote.
    with translate_read_errors(store.root):
        latest = store.read_latest()
    chosen, why = _of_latest_run(store, matching, latest, names), "of the run latest names"
    if chosen is None:
        plain = [n for n in (checkpoint_name(step, style=style) for style in NAME_STYLES) if n in matching]
        chosen, why = (plain[0] if plain else matching[-1]), "the first run's"
    warnings.warn(
        f"overlapckpt: {store.root} holds {len(matching)} checkpoints of step {step} ({', '.join(matching)}), from runs "
        f"that diverged after a rollback; loading {chosen} ({why}). Pass one checkpoint directory as the path to load another",
        stacklevel=3,
    )
    return chosen


def _of_latest_run(store: CheckpointStore, matching: list[str], latest: str | None, names: list[str]) -> str | None:
    """The one of ``matching`` that ``latest``'s run wrote, if ``latest`` names a readable checkpoint."""
    if latest is None or latest not in names:
        return None
    if latest in matching:
        return latest
    try:
        run = read_manifest(store, latest).run_id
        for name, manifest in listable(store, matching):
            if run is not None and manifest.run_id == run:
                return name
    except CorruptCheckpointError:
        return None
    return None


def split_checkpoint_path(path: str, storage_options: dict[str, Any] | None) -> tuple[CheckpointStore, str | None]:
    """(store of the root, checkpoint name) when ``path`` is one checkpoint directory, else (store of ``path``, None)."""
    text = str(path).rstrip("/")
    name = text.rsplit("/", 1)[-1]
    if step_of_name(name) is not None and "/" in text:
        parent = CheckpointStore(text.rsplit("/", 1)[0] or "/", storage_options)
        with translate_read_errors(text):
            if parent.is_committed(name):
                return parent, name
    return CheckpointStore(path, storage_options), None


def checkpoint_at(path: str, step: int | None, storage_options: dict[str, Any] | None) -> tuple[CheckpointStore, str]:
    """(the root's store, the checkpoint's name): ``path`` is one checkpoint directory, or the root (``step``, else the newest)."""
    store, name = split_checkpoint_path(path, storage_options)
    if name is None:
        return store, resolve_checkpoint(store, step)
    if step is not None and step_of_name(name) != step:
        raise ConfigError(f"path {path!r} is the checkpoint of step {step_of_name(name)}, but step={step}; pass one or the other")
    return store, name


def holds_checkpoints(path: str, storage_options: dict[str, Any] | None) -> bool:
    """Whether ``path`` is a committed checkpoint directory, or a root with at least one committed checkpoint."""
    store, name = split_checkpoint_path(path, storage_options)
    return name is not None or bool(store.committed_names())


def anything_to_restore(path: str, local_dir: str | None, storage_options: dict[str, Any] | None, group: Any = None) -> bool:
    """Whether ``path`` (a root or one checkpoint directory), or the local tier ``local_dir``, holds a committed checkpoint.

    Under torch.distributed every rank gets the same answer: a node's local tier is its own,
    so one node's checkpoint makes it true for all (the restore then fetches or falls back).
    Storage that cannot be read raises CheckpointReadError: it is not an empty root, and a
    run that started fresh over it would name its checkpoints as if nothing came before.
    """
    with translate_read_errors(str(path)):
        found = holds_checkpoints(path, storage_options) or bool(local_dir and CheckpointStore(local_dir).committed_names())
    if group is None:
        return found
    import torch.distributed as dist

    answers: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(answers, found, group=group)
    return any(answers)
