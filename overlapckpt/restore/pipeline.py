"""``load``: restore a committed checkpoint in place, as a short pipeline of the package's steps: locate, check, read, apply."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, overload

import torch
from torch import nn

from ..errors import (
    CheckpointNotFoundError,
    ConfigError,
    OverlapCkptError,
)
from ..format.blob_reader import ADOPT, CHECK, PLACE
from ..format.manifest import CheckpointInfo
from ..format.tiers import LOCAL_TIER, ROOT_TIER
from ..format.verify import VerifyShare, read_manifest
from ..optimizers import each_optimizer, torch_optimizers, unwrap_optimizer
from ..restore_marks import mark_restored
from ..settings import check_optimizer_matches_model
from ..user_log import say_fresh, say_resumed
from .apply import LiveObjectsKept, apply_state_dicts, live_state_dicts, named_as, restore_extra_state, unnamed
from .check import (
    PER_RANK_STATE_CHOICES,
    ManifestChecks,
    check_items_stored,
    check_optimizer_matches,
    check_signed,
    check_stateful_names,
    checked_manifest,
    per_rank_extra_state,
    warn_of_stateful_not_given,
)
from .locate import anything_to_restore, checkpoint_at
from .plan import files_in_load_plan
from .read import ReadOptions, agree_before_reading, empty_like_on_cpu, read_into, world_of
from .tiers import Fetch, RestoreReport, RestoreScope, Source, from_newest_tier


@dataclass(frozen=True)
class LoadTargets:
    """The live objects a load writes into, in place."""

    model: nn.Module
    optimizer: torch.optim.Optimizer | None  # None: the optimizers' state is not read
    stateful: dict[str, Any] | None = None


@dataclass(frozen=True)
class LoadOptions:
    """How a load reads: which version, from where, how checked, and what it restores per rank (``load``'s keywords)."""

    step: int | None = None
    storage_options: dict[str, Any] | None = None
    verify: bool = True
    per_rank_state: str = "restore"
    process_group: Any = None
    signing_key: str | bytes | None = None
    local_dir: str | os.PathLike[str] | None = None
    missing_ok: bool = False


@overload
def load(
    path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None, stateful: dict[str, Any] | None = ...,
    step: int | None = ..., storage_options: dict[str, Any] | None = ..., verify: bool = ..., *, per_rank_state: str = ...,
    process_group: Any = ..., signing_key: str | bytes | None = ..., local_dir: str | os.PathLike[str] | None = ...,
    missing_ok: Literal[False] = ...,
) -> CheckpointInfo: ...


@overload
def load(
    path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None, stateful: dict[str, Any] | None = ...,
    step: int | None = ..., storage_options: dict[str, Any] | None = ..., verify: bool = ..., *, per_rank_state: str = ...,
    process_group: Any = ..., signing_key: str | bytes | None = ..., local_dir: str | os.PathLike[str] | None = ...,
    missing_ok: bool,
) -> CheckpointInfo | None: ...


def load(
    path: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    stateful: dict[str, Any] | None = None,
    step: int | None = None,
    storage_options: dict[str, Any] | None = None,
    verify: bool = True,
    *,
    per_rank_state: str = "restore",
    process_group: Any = None,
    signing_key: str | bytes | None = None,
    local_dir: str | os.PathLike[str] | None = None,
    missing_ok: bool = False,
) -> CheckpointInfo | None:
    """Restore a committed checkpoint in place: model, optimizer, stateful objects and RNG states.

    ``path`` is the checkpoint root (``step=None`` loads the newest committed
    checkpoint) or one checkpoint directory (``CheckpointInfo.path``). The checkpoint
    is checked first (shapes; with ``verify``, every byte), so a mismatched or corrupt
    checkpoint raises before any live object changes. With ``verify``, ``.metadata``
    and every shard's size are checked first, then every blob the load needs against
    the manifest's checksums, before it is decoded (CorruptCheckpointError naming the
    file and blob), and each tensor against the checksum of the snapshot it was saved
    from. From a local directory that check hashes the shards' pages in place, and a
    second pass reads the tensors straight into the live ones (nothing else is
    allocated); from object storage, one read into host memory serves both. With
    ``verify=False`` nothing is checked: a damaged checkpoint can fail halfway, and the
    error then says that the objects are partly loaded.
    (``overlapckpt verify`` checks every stored byte, blobs this load does not read too.) Storage
    failures raise CheckpointReadError, never CorruptCheckpointError.

    Under torch.distributed, ``load`` is collective (every rank calls it) and reshards
    through DCP: a checkpoint written at any world size and parallelism loads into
    any other. Stateful objects and RNG states are per rank: they are restored only
    at the world size that wrote them; at another one, CheckpointMismatchError names
    both sizes unless ``per_rank_state="skip"`` loads model and optimizer only.

    ``local_dir``: a node-local tier (``Checkpointer(local_every=...)``) to consider first.
    Its newest checkpoint is loaded when it is at least as new as the root's, was written
    at this world size, and every file of it is in this node's tier (across nodes, every
    node's: ``Checkpointer.restore()`` also fetches a partner's replicas for a node that
    lacks them); a refused one (corrupt, missing) is skipped with a warning naming it, and
    the root is loaded (``restore/tiers.py``).
    The choice, and the time the load took, are logged.

    ``missing_ok=True``: when neither the root nor ``local_dir`` holds any committed
    checkpoint (a first run), return None and leave every object untouched, instead of
    raising CheckpointNotFoundError: the one line that resumes if there is anything, else
    starts fresh. A load that fails for any other reason raises, and leaves the live
    objects as they were (the optimizer's state is not created).
    """
    options = LoadOptions(step, storage_options, verify, per_rank_state, process_group, signing_key, local_dir, missing_ok)
    return _from_tiers(path, LoadTargets(model, optimizer, stateful), options, None, None)


def load_fetching_replicas(
    fetch: Fetch, path: str, targets: LoadTargets, options: LoadOptions, report: RestoreReport
) -> CheckpointInfo | None:
    """``load`` for ``Checkpointer.restore()``: across nodes, a node that lacks local-tier files gets them through
    ``fetch`` (the writers); in one process it is never called. ``report`` is filled with where it read from and
    what each part took. None only with ``options.missing_ok`` and nothing committed."""
    return _from_tiers(path, targets, options, fetch, report)


def _from_tiers(
    path: str, targets: LoadTargets, options: LoadOptions, fetch: Fetch | None, report: RestoreReport | None
) -> CheckpointInfo | None:
    group, rank, world = world_of(options.process_group)
    # A wrapper: the optimizer inside; a container of optimizers (TorchTitan's): those it steps.
    optimizers = None if targets.optimizer is None else torch_optimizers(unwrap_optimizer(targets.optimizer))
    for each in each_optimizer(optimizers):
        check_optimizer_matches_model(targets.model, each, given_to="load")
    directory = None if options.local_dir is None else os.fspath(options.local_dir)
    options = dataclasses.replace(options, local_dir=directory)  # one form from here on: a str or None
    # Before anything touches a live object: a first run has nothing to restore, on every rank alike.
    if options.step is None and not anything_to_restore(path, directory, options.storage_options, group):
        if options.missing_ok:
            say_fresh(path, directory)
            return None
        raise CheckpointNotFoundError(
            f"no committed checkpoint under {path!r}{'' if directory is None else f' or in the local tier {directory!r}'}; "
            "check the path, or pass missing_ok=True to start fresh when there is none (a first run)"
        )
    started = time.perf_counter()
    report = report if report is not None else RestoreReport()
    with LiveObjectsKept(optimizers):
        info = _read_newest(path, targets, optimizers, options, fetch, report)
    say_resumed(info.path, info.step, report.source, time.perf_counter() - started)
    return info


def _read_newest(
    path: str,
    targets: LoadTargets,
    optimizers: Any,  # torch_optimizers' value: None, one optimizer, or a group's tuple
    options: LoadOptions,
    fetch: Fetch | None,
    report: RestoreReport | None,
) -> CheckpointInfo:
    group, rank, world = world_of(options.process_group)
    live = live_state_dicts(targets.model, optimizers)  # collective for some parallelisms: every rank, first; once for every source
    # One local checkpoint directory is read as itself: no step to look up, no storage options.
    from_directory = dataclasses.replace(options, step=None, storage_options=None)

    def read(source: Source) -> CheckpointInfo:
        if source.is_root:
            info = _load_one(source.url, targets, optimizers, live, options)
        else:  # of a local checkpoint directory, this rank checks the files it reads
            info = _load_one(source.url, targets, optimizers, live, from_directory, files=source.files)
        return dataclasses.replace(info, tier=ROOT_TIER if source.is_root else LOCAL_TIER)

    def files_read(where: str) -> frozenset[str]:
        store, name = checkpoint_at(where, None, None)
        manifest = read_manifest(store, name)
        # With a key, authenticity first: nothing of .metadata is decoded before its signature holds.
        check_signed(store, name, manifest, options.signing_key)
        return files_in_load_plan(store, name, manifest, named_as(manifest.key_layout, *live), rank == 0)

    scope = RestoreScope(path, options.step, options.storage_options, group, world)
    return from_newest_tier(scope, options.local_dir, read, fetch, files_read, report)


@dataclass
class _Checked:
    """What the checks before any read established, on one rank: where, what, and what to put back on a failure."""

    store: Any = None
    name: str | None = None
    manifest: Any = None
    target: dict[str, Any] = field(default_factory=dict)  # the live tensors, named as the checkpoint names them
    extra: dict[str, Any] = field(default_factory=dict)  # this rank's stateful objects and RNG states
    undo_extra: Callable[[], None] | None = None
    key: bytes | None = None  # the signing key, once the signature held
    verify: bool = True


def _load_one(
    path: str,
    targets: LoadTargets,
    optimizers: list[torch.optim.Optimizer] | None,
    live: tuple[dict[str, Any], dict[str, Any] | None],
    options: LoadOptions,
    files: frozenset[str] | None = None,
) -> CheckpointInfo:
    """``load`` from one source: the root, or one checkpoint directory."""
    if options.per_rank_state not in PER_RANK_STATE_CHOICES:
        raise ConfigError(f"per_rank_state={options.per_rank_state!r} is invalid; use 'restore' or 'skip'")
    group, rank, world = world_of(options.process_group)
    checked = _Checked(verify=options.verify)
    failure: BaseException | None = None
    try:
        _check_before_reading(path, targets, live, options, files, (rank, world), checked)
    except OverlapCkptError as e:  # raised on every rank below, before any rank reads
        failure = e
    except Exception as e:  # noqa: BLE001 - a stateful object's own load_state_dict: raised below, as it is
        failure = e
    try:
        agree_before_reading(group, failure, checked.name)
        if checked.name is None:  # every rank agreed above that nothing failed, so the name was resolved
            raise CheckpointNotFoundError(f"no checkpoint under {path!r} to load")
        store, name, manifest = checked.store, checked.name, checked.manifest
        where = store.checkpoint_url(name)
        host = _read_tensors(store, name, checked.target, group, manifest, checked.verify, checked.key)
        if options.per_rank_state == "restore":
            warn_of_stateful_not_given(checked.extra, targets.stateful or {}, where)
        model_sd, optim_sd = unnamed(manifest.key_layout, host, live[1])
        apply_state_dicts(targets.model, optimizers, model_sd, optim_sd)
    except BaseException:
        if checked.undo_extra is not None:
            checked.undo_extra()
        raise
    info = CheckpointInfo.from_manifest(manifest, where)
    if targets.optimizer is not None:
        # A Checkpointer built next on these objects continues this version count (restore_marks.py).
        mark_restored(targets.model, unwrap_optimizer(targets.optimizer), optimizers, info)
    return info


def _check_before_reading(
    path: str,
    targets: LoadTargets,
    live: tuple[dict[str, Any], dict[str, Any] | None],
    options: LoadOptions,
    files: frozenset[str] | None,
    rank_and_world: tuple[int, int],
    checked: _Checked,
) -> None:
    """Every check before any rank reads, filling ``checked`` as it goes; the per-rank state restored last."""
    msd, osd = live
    checked.store, checked.name = store, name = checkpoint_at(path, options.step, options.storage_options)

    def target_for(key_layout: str) -> dict[str, Any]:
        checked.target.update(named_as(key_layout, msd, osd))
        return checked.target

    # With a key, authenticity first: nothing of .metadata is decoded before its signature holds.
    manifest = read_manifest(store, name)
    checked.key = check_signed(store, name, manifest, options.signing_key)
    # With a key every blob read is checked against its MAC, verify or not: the key's promise
    # is that nothing unauthenticated is loaded.
    checked.verify = options.verify or checked.key is not None
    share = VerifyShare(rank=rank_and_world[0], world_size=rank_and_world[1], files=files)
    checks = ManifestChecks(share, options.per_rank_state, checked.verify)
    checked.manifest = manifest = checked_manifest(store, name, manifest, checks, target_for)
    if targets.optimizer is not None:
        check_optimizer_matches(manifest, unwrap_optimizer(targets.optimizer), store.checkpoint_url(name))
    check_items_stored(manifest, checked.target, store.checkpoint_url(name))
    if options.per_rank_state == "restore":  # before reading: the reads write into the live tensors
        checked.extra = per_rank_extra_state(manifest, rank_and_world[0])
        check_stateful_names(checked.extra, targets.stateful or {}, store.checkpoint_url(name))
        # The stateful objects and RNG states first, before any tensor changes (a local read places
        # into the live tensors): one that fails leaves the tensors as they were, and the ones loaded
        # before it are put back; a failure after this puts them all back (undo_extra).
        checked.undo_extra = restore_extra_state(checked.extra, targets.stateful or {})


# A verified load of local files reads in two passes (check, then place into the live tensors)
# from this many bytes of tensors; below it, once, into host tensors of its own (ADOPT).
TWO_PASS_MIN_BYTES = 64 << 20


def _tensor_nbytes(value: Any) -> int:
    """The bytes of the tensors in a (nested) state dict: a DTensor's local shard's."""
    if isinstance(value, torch.Tensor):
        to_local = getattr(value, "to_local", None)
        local = to_local() if callable(to_local) else value
        return local.numel() * local.element_size()
    if isinstance(value, dict):
        return sum(_tensor_nbytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_nbytes(v) for v in value)
    return 0


def _read_tensors(
    store: Any, name: str, target: dict[str, Any], group: Any, manifest: Any, verify: bool, signing_key: bytes | None
) -> dict[str, Any]:
    """The checkpoint's tensors: into ``target``'s live tensors from local files, else into host tensors of the load's own.

    ``signing_key``: each blob's MAC is checked too (the manifest's signature was, with it).
    """
    if store.is_local and (not verify or _tensor_nbytes(target) >= TWO_PASS_MIN_BYTES):
        # Local files: a second read comes from the page cache at memory speed. The first pass
        # reads and checks every blob and changes nothing; the second reads into the live
        # tensors themselves, which are in memory already. Host tensors of the load's own
        # would fault in fresh memory, a page per 4 KiB: that made load bimodal (direct_read.py).
        # The second pass checks again only what changed since the first (it refuses it).
        checked = read_into(store, name, target, group, ReadOptions(manifest, CHECK, signing_key=signing_key)) if verify else None
        read_into(store, name, target, group, ReadOptions(manifest if verify else None, PLACE, checked_files=checked, signing_key=signing_key))
        return target
    # A second read would be a second download: one read, into host tensors of the load's own.
    # So for a small state on local files too: its fresh memory faults in at once, and a second
    # pass would plan and walk every blob again (30,000 small tensors: seconds of per-blob Python).
    host = empty_like_on_cpu(target)
    read_into(store, name, host, group, ReadOptions(manifest if verify else None, ADOPT, signing_key=signing_key))
    return host
