"""Read committed checkpoints: list them, verify them, restore them in place."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any, cast

import torch
from torch import nn

from .errors import (
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointReadError,
    ConfigError,
    CorruptCheckpointError,
    OverlapCkptError,
    RankDisagreementError,
    SignatureError,
    UnsafeCheckpointError,
)
from .format.entries import check_shapes, flatten_tensors
from .format.extra_state import decode
from .format.key_layout import TORCHTITAN, flat_param_groups, saved_group
from .format.manifest import METADATA_NAME, NAME_STYLES, CheckpointInfo, Manifest, checkpoint_name, step_of_name
from .format.safe_read import SafeLoadPlanner
from .format.signing import check_signature, resolve_key
from .format.storage import CheckpointStore, dcp_root_cause, is_storage_error, read_error, translate_read_errors
from .format.verified_read import ExpectedSums
from .format.verify import describe_problems, read_manifest, verify_checkpoint
from .optimizers import torch_optimizers, unwrap_optimizer
from .restore_marks import mark_restored


def _listable(store: CheckpointStore, names: Iterable[str]) -> Iterator[tuple[str, Manifest]]:
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
    for name, manifest in _listable(store, newer):
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
    return [CheckpointInfo.from_manifest(m, store.checkpoint_url(n)) for n, m in _listable(store, names)]


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
        for name, manifest in _listable(store, preferred):
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
        for name, manifest in _listable(store, matching):
            if run is not None and manifest.run_id == run:
                return name
    except CorruptCheckpointError:
        return None
    return None


def read_into(
    store: CheckpointStore, name: str, host: dict[str, Any], process_group: Any = None, manifest: Manifest | None = None
) -> None:
    """Fill host tensors from checkpoint ``name`` with DCP (collectively with ``process_group`` when given).

    With ``manifest``, every blob is checked as it is read, and every decoded tensor
    against the snapshot it was saved from (``format/verified_read.py``).
    CheckpointReadError if storage fails, CorruptCheckpointError if the bytes are
    damaged or cannot be decoded.
    """
    import torch.distributed.checkpoint as dcp

    where = store.checkpoint_url(name)
    reader = store.make_reader(name)
    expect = getattr(reader, "expect", None)
    if expect is not None:  # each blob read once, on several threads; checked as it arrives with a manifest
        expect(None if manifest is None else ExpectedSums.from_manifest(manifest, where))
    elif manifest is not None:
        raise ConfigError(
            f"{type(store).__name__}.make_reader returned a {type(reader).__name__}, which cannot check blobs as it "
            "reads; build it with format.verified_read.verified_reader_class, or load with verify=False"
        )
    try:
        with translate_read_errors(f"{where}/.metadata"):
            reader.read_metadata()  # through the allowlist, and raised with its type (DCP would stringify it)
        if process_group is not None:
            dcp.load(host, storage_reader=reader, planner=SafeLoadPlanner(), process_group=process_group)
        else:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
                dcp.load(host, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    except (KeyboardInterrupt, SystemExit, OverlapCkptError):
        raise
    except BaseException as e:  # DCP's CheckpointException derives from BaseException
        cause = dcp_root_cause(e)
        if isinstance(cause, (UnsafeCheckpointError, CorruptCheckpointError)):
            raise cause from e
        if is_storage_error(cause):
            raise read_error(f"the checkpoint {where}", cause) from cause
        raise CorruptCheckpointError(f"reading the checkpoint {where} failed: {type(cause).__name__}: {cause}") from cause


def _empty_like_on_cpu(value: Any) -> Any:
    """Host tensors to read a checkpoint into, shaped like ``value`` (a DTensor keeps its placement)."""
    if isinstance(value, torch.Tensor):
        to_local = getattr(value, "to_local", None)
        if callable(to_local):
            from torch.distributed.tensor import DTensor

            local = to_local()
            value = cast(DTensor, value)
            return DTensor.from_local(
                torch.empty(local.shape, dtype=local.dtype, device="cpu"),
                value.device_mesh,
                value.placements,
                run_check=False,
                shape=value.shape,
                stride=value.stride(),
            )
        return torch.empty(value.shape, dtype=value.dtype, device="cpu")
    if isinstance(value, dict):
        return {k: _empty_like_on_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_empty_like_on_cpu(v) for v in value]
    return value


PER_RANK_STATE_CHOICES = ("restore", "skip")


def _split_checkpoint_path(path: str, storage_options: dict[str, Any] | None) -> tuple[CheckpointStore, str | None]:
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
    store, name = _split_checkpoint_path(path, storage_options)
    if name is None:
        return store, resolve_checkpoint(store, step)
    if step is not None and step_of_name(name) != step:
        raise ConfigError(f"path {path!r} is the checkpoint of step {step_of_name(name)}, but step={step}; pass one or the other")
    return store, name


def check_signed(store: CheckpointStore, name: str, manifest: Manifest, signing_key: str | bytes | None) -> None:
    """With a key (``signing_key`` or the environment), refuse unsigned and forged checkpoints, whatever verify says."""
    key = resolve_key(signing_key)
    if key is None:
        return
    with translate_read_errors(store.checkpoint_url(name)):
        metadata_bytes = store.read_bytes(name, METADATA_NAME)
    check_signature(manifest.raw, metadata_bytes, key, store.checkpoint_url(name))


def holds_checkpoints(path: str, storage_options: dict[str, Any] | None) -> bool:
    """Whether ``path`` is a committed checkpoint directory, or a root with at least one committed checkpoint."""
    store, name = _split_checkpoint_path(path, storage_options)
    return name is not None or bool(store.committed_names())


def _world(process_group: Any) -> tuple[Any, int, int]:
    """(the group to load with, or None in one process; this rank; the world size)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size(process_group) > 1:
        return (process_group or dist.group.WORLD), dist.get_rank(process_group), dist.get_world_size(process_group)
    return None, 0, 1


def _agree_before_reading(group: Any, error: BaseException | None, name: str | None) -> None:
    """Distributed: raise on every rank if any rank failed its checks or resolved another checkpoint.

    Run before DCP's collective read, so that no rank is left waiting in it. A rank
    that failed raises its own error; the others raise the same type, naming that rank.
    """
    if group is None:
        if error is not None:
            raise error
        return
    import torch.distributed as dist

    outcome = (name, None if error is None else (type(error).__name__, str(error)))
    outcomes: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(outcomes, outcome, group=group)
    if error is not None:
        raise error
    for rank, (_, failure) in enumerate(outcomes):
        if failure is not None:
            error_type = _ERROR_TYPES.get(failure[0], CorruptCheckpointError)
            raise error_type(f"loading failed on rank {rank}: {failure[0]}: {failure[1]}")
    names = [n for n, _ in outcomes]
    if any(n != names[0] for n in names):
        per_rank = ", ".join(f"rank {r}: {n}" for r, n in enumerate(names))
        raise RankDisagreementError(
            f"the ranks resolved different checkpoints to load ({per_rank}); pass the same path and step on every "
            "rank (with step=None, a checkpoint committed while the ranks were resolving can cause this: retry)"
        )


_ERROR_TYPES: dict[str, type[OverlapCkptError]] = {
    cls.__name__: cls
    for cls in (
        CheckpointMismatchError,
        CheckpointNotFoundError,
        CheckpointReadError,
        ConfigError,
        CorruptCheckpointError,
        SignatureError,
        UnsafeCheckpointError,
    )
}


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
) -> CheckpointInfo:
    """Restore a committed checkpoint in place: model, optimizer, stateful objects and RNG states.

    ``path`` is the checkpoint root (``step=None`` loads the newest committed
    checkpoint) or one checkpoint directory (``CheckpointInfo.path``). The checkpoint
    is read into host memory and checked first (shapes, then per-item checksums when
    ``verify``), so a mismatched or corrupt checkpoint raises before any live object
    changes. With ``verify``, ``.metadata`` and every shard's size are checked first,
    then every blob read is checked against the manifest's checksums as it arrives,
    before it is decoded (CorruptCheckpointError naming the file and blob), and each
    decoded tensor against the checksum of the snapshot it was saved from: one read.
    (``overlapckpt verify`` checks every stored byte, blobs this load does not read too.) Storage
    failures raise CheckpointReadError, never CorruptCheckpointError.

    Under torch.distributed, ``load`` is collective (every rank calls it) and reshards
    through DCP: a checkpoint written at any world size and parallelism loads into
    any other. Stateful objects and RNG states are per rank: they are restored only
    at the world size that wrote them; at another one, CheckpointMismatchError names
    both sizes unless ``per_rank_state="skip"`` loads model and optimizer only.
    """
    if per_rank_state not in PER_RANK_STATE_CHOICES:
        raise ConfigError(f"per_rank_state={per_rank_state!r} is invalid; use 'restore' or 'skip'")
    group, rank, world = _world(process_group)
    # A wrapper: the optimizer inside; a container of optimizers (TorchTitan's): those it steps.
    optimizers = None if optimizer is None else torch_optimizers(unwrap_optimizer(optimizer))
    msd, osd = live_state_dicts(model, optimizers)  # collective for some parallelisms: every rank, first
    target: dict[str, Any] = {}
    failure: BaseException | None = None
    name: str | None = None
    try:
        store, name = checkpoint_at(path, step, storage_options)

        def target_for(key_layout: str) -> dict[str, Any]:
            target.update(named_as(key_layout, msd, osd))
            return target

        # With a key, authenticity first: nothing of .metadata is decoded before its signature holds.
        check_signed(store, name, read_manifest(store, name), signing_key)
        manifest = _checked_manifest(store, name, (rank, world), per_rank_state, verify, target_for)
        if optimizer is not None:
            check_optimizer_matches(manifest, unwrap_optimizer(optimizer), store.checkpoint_url(name))
        check_items_stored(manifest, target, store.checkpoint_url(name))
    except OverlapCkptError as e:  # raised on every rank below, before any rank reads
        failure = e
    _agree_before_reading(group, failure, name)
    where = store.checkpoint_url(name)  # type: ignore[arg-type]

    host = _empty_like_on_cpu(target)
    if name is None:  # every rank agreed above that nothing failed, so the name was resolved
        raise CheckpointNotFoundError(f"no checkpoint under {path!r} to load")
    read_into(store, name, host, group, manifest if verify else None)

    extra = _per_rank_extra_state(manifest, rank) if per_rank_state == "restore" else {}
    if per_rank_state == "restore":
        _check_stateful_names(extra, stateful or {}, where)
        _warn_of_stateful_not_given(extra, stateful or {}, where)
    model_sd, optim_sd = unnamed(manifest.key_layout, host, osd)
    apply_state_dicts(model, optimizers, model_sd, optim_sd)
    if per_rank_state == "restore":
        _restore_extra_state(extra, stateful or {})
    info = CheckpointInfo.from_manifest(manifest, where)
    if optimizer is not None:
        # A Checkpointer built next on these objects continues this version count (restore_marks.py).
        mark_restored(model, unwrap_optimizer(optimizer), optimizers, info)
    return info


def live_state_dicts(model: nn.Module, optimizers: list[torch.optim.Optimizer] | None) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The model's state dict and the optimizers' (None without any), as ``get_state_dict`` names them (a collective)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizers is None:
        return get_model_state_dict(model), None
    return get_state_dict(model, optimizers)


def apply_state_dicts(
    model: nn.Module, optimizers: list[torch.optim.Optimizer] | None, model_sd: dict[str, Any], optim_sd: dict[str, Any] | None
) -> None:
    """Set what ``live_state_dicts`` named, read back from a checkpoint."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    if optimizers is None:
        model.load_state_dict(model_sd)
    else:
        set_state_dict(model, optimizers, model_state_dict=model_sd, optim_state_dict=cast(Any, optim_sd))


def named_as(key_layout: str, msd: dict[str, Any], osd: dict[str, Any] | None) -> dict[str, Any]:
    """The state dict to read a checkpoint of ``key_layout`` into, from ``get_state_dict``'s model and optimizer parts."""
    if key_layout != TORCHTITAN:
        return {"model": msd} if osd is None else {"model": msd, "optimizer": osd}
    if osd is None:
        return dict(msd)
    return {**msd, "optimizer": {"state": osd["state"], **flat_param_groups(osd["param_groups"])}}


def unnamed(key_layout: str, host: dict[str, Any], osd: dict[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Invert :func:`named_as` on what was read: (model state dict, optimizer state dict by name)."""
    if key_layout != TORCHTITAN:
        return host["model"], host.get("optimizer")
    model_sd = {k: v for k, v in host.items() if k != "optimizer"}
    if osd is None:
        return model_sd, None
    flat = host["optimizer"]
    return model_sd, {"state": flat["state"], "param_groups": [saved_group(flat, live) for live in osd["param_groups"]]}


def _checked_manifest(
    store: CheckpointStore,
    name: str,
    share: tuple[int, int],
    per_rank_state: str,
    verify: bool,
    target: dict[str, Any] | Callable[[str], dict[str, Any]],
) -> Manifest:
    """The manifest of ``name``, once everything that can be checked before reading has passed."""
    where = store.checkpoint_url(name)
    manifest = read_manifest(store, name)
    try:
        return _checked_fields(store, name, manifest, share, per_rank_state, verify, target, where)
    except OverlapCkptError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        # A manifest whose checksum matches but whose fields have the wrong types: named, and
        # raised as an OverlapCkptError so every rank agrees on it before any collective.
        raise CorruptCheckpointError(f"{where}/overlapckpt.json has a malformed field: {type(e).__name__}: {e}") from e


def _checked_fields(
    store: CheckpointStore,
    name: str,
    manifest: Manifest,
    share: tuple[int, int],
    per_rank_state: str,
    verify: bool,
    target: dict[str, Any] | Callable[[str], dict[str, Any]],
    where: str,
) -> Manifest:
    if callable(target):
        target = target(manifest.key_layout)
    world = share[1]
    saved_world = manifest.world_size
    if per_rank_state == "restore" and saved_world != world:
        raise CheckpointMismatchError(
            f"{where} was written by {saved_world} rank(s) and is loaded by {world}: its stateful objects and RNG "
            "states are per rank and cannot be restored here; load at the same world size, or pass "
            "per_rank_state='skip' to restore model and optimizer only"
        )
    if verify:
        # Before reading: .metadata's bytes, and every shard's kind and size (each rank of a
        # distributed load checks a 1/N share of the files; a rank that finds damage fails,
        # and the agreement below makes every rank raise). The blobs are checked as they
        # are read, once, in read_into (format/verified_read.py). This is integrity (a
        # flipped bit, a truncated shard), not authenticity: whoever can write the files can
        # recompute CRCs. What keeps a crafted file from running code is the reading itself
        # (safe_read.py), with or without verify.
        report = verify_checkpoint(store, name, manifest, share, read_blobs=False)
        if not report.ok:
            # The detailed account (which blob a truncation cuts): read everything, once, on failure only.
            report = verify_checkpoint(store, name, manifest, share)
            raise CorruptCheckpointError(
                f"reading the checkpoint {where} failed verification: {describe_problems(report)}; restore from an "
                "older checkpoint (list_checkpoints), or pass verify=False to inspect it"
            )
    expected = {k: v.shape for k, v in manifest.items.items()}
    check_shapes(expected, flatten_tensors(target))
    return manifest


def _per_rank_extra_state(manifest: Manifest, rank: int) -> dict[str, Any]:
    return decode(manifest.extra_state_of(rank))


def _check_stateful_names(extra: dict[str, Any], stateful: dict[str, Any], where: str) -> None:
    saved = extra.get("stateful", {})
    missing = [name for name in stateful if name not in saved]
    if missing:
        raise CheckpointMismatchError(
            f"stateful objects {missing} are not in {where}, which holds {sorted(saved)}; pass the same "
            "stateful names that were saved"
        )


def _warn_of_stateful_not_given(extra: dict[str, Any], stateful: dict[str, Any], where: str) -> None:
    """A checkpoint's stateful objects that load() was not given stay as they are: warn (a user may mean it)."""
    not_given = sorted(set(extra.get("stateful", {})) - set(stateful))
    if not_given:
        warnings.warn(
            f"overlapckpt: {where} holds stateful objects {not_given} that load() was not given: they are not restored "
            f"(an LR scheduler's lr is, in the optimizer, but not its position, last_epoch). Pass "
            f"stateful={{{', '.join(repr(n) + ': ...' for n in not_given)}}} to restore them",
            stacklevel=3,
        )


def check_optimizer_matches(manifest: Manifest, optimizer: Any, where: str) -> None:
    """The live optimizer has the update rule whose state the checkpoint holds (checkpoints that record it)."""
    from .optimizers import update_rule_name

    live = update_rule_name(optimizer)
    if manifest.optimizer is not None and manifest.optimizer != live:
        raise CheckpointMismatchError(
            f"{where} holds the state of a {manifest.optimizer}, and is loaded into a {live}: the state would be "
            "restored into an optimizer that reads it differently. Build the optimizer that was saved, or pass "
            "optimizer=None to restore the model only"
        )


def check_items_stored(manifest: Manifest, target: dict[str, Any], where: str) -> None:
    """Every non-tensor item the live objects have is stored (tensors: ``check_shapes``), before any read.

    An LR scheduler attached to the optimizer adds ``initial_lr`` to its param_groups; a
    checkpoint written without one lacks it, which DCP reported as a corrupt checkpoint
    ("Missing key ... initial_lr"): it is a mismatch of the objects, named here.
    """
    try:
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    except ImportError:  # a torch without it: DCP names the key itself when it reads
        return
    if manifest.checksums is None:
        return  # format 1: no record of the stored keys
    stored = {blob.key.split("@", 1)[0] for f in manifest.checksums.files.values() for blob in f.blobs}
    flat, _ = flatten_state_dict(target)
    missing = sorted(k for k, v in flat.items() if not isinstance(v, torch.Tensor) and k not in stored)
    if not missing:
        return
    if any(k.endswith(".initial_lr") for k in missing):
        why = (
            "an LR scheduler attached to the optimizer adds 'initial_lr' to its param_groups, and the checkpoint was "
            "written without one: create the scheduler after load(), or save with it (stateful={'scheduler': ...})"
        )
    else:
        why = "the optimizer's param_groups differ from the saved ones: build the optimizer with the options that were saved"
    raise CheckpointMismatchError(f"the objects being loaded have {missing[:5]} that {where} does not store: {why}")


def _restore_extra_state(extra: dict[str, Any], stateful: dict[str, Any]) -> None:
    saved = extra.get("stateful", {})
    for name, obj in stateful.items():
        obj.load_state_dict(saved[name])
    restore_rng(extra.get("rng", {}))


def restore_rng(rng: dict[str, Any]) -> None:
    """Set the RNG states a checkpoint saved (torch's CPU generator, and CUDA's on as many devices)."""
    if "torch_cpu" in rng:
        torch.set_rng_state(rng["torch_cpu"])
    cuda_states = rng.get("torch_cuda")
    if cuda_states and torch.cuda.is_available() and len(cuda_states) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda_states)
