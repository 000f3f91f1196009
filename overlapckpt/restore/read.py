"""Reading a checkpoint's tensors into host memory through DCP, each blob checked as it arrives, the ranks agreeing first."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, cast

import torch

from ..errors import (
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
from ..format.blob_reader import ADOPT, PLACE, FileIdentity
from ..format.expected_sums import ExpectedSums
from ..format.manifest import Manifest
from ..format.safe_unpickle import SafeLoadPlanner
from ..format.storage import CheckpointStore, dcp_root_cause, is_storage_error, read_error, translate_read_errors


@dataclass(frozen=True)
class ReadOptions:
    """How ``read_into`` reads: what it checks each blob against, and whose tensors it fills."""

    manifest: Manifest | None = None  # every blob checked against it as it is read; None: nothing checked
    mode: str = ADOPT  # ADOPT, CHECK or PLACE (format/blob_reader.py)
    checked_files: dict[str, FileIdentity] | None = None  # what a CHECK pass returned: read without checking again
    signing_key: bytes | None = None  # with ``manifest``, whose signature was checked with it: each blob's MAC too


def read_into(
    store: CheckpointStore,
    name: str,
    host: dict[str, Any],
    process_group: Any = None,
    options: ReadOptions | None = None,
) -> dict[str, FileIdentity]:
    """Fill the tensors of ``host`` from checkpoint ``name`` with DCP (collectively with ``process_group`` when given).

    With ``options.manifest``, every blob is checked as it is read, and every decoded tensor
    against the snapshot it was saved from (``format/blob_reader.py``). ``options.mode``: ADOPT
    (``host`` holds tensors this load allocated: decoded ones take their place), CHECK
    (read and check only) or PLACE (``host`` holds the live tensors: read into them).
    ``options.checked_files``: what a CHECK pass returned; the files it checked, found unchanged,
    are read without checking their bytes again. ``options.signing_key`` (with the manifest, whose
    signature was checked with it): each blob's MAC is checked too. Returns the local files read, by name.
    CheckpointReadError if storage fails, CorruptCheckpointError if the bytes are
    damaged or cannot be decoded.
    """
    options = options if options is not None else ReadOptions()
    reader = store.make_reader(name)
    try:
        return _read_into(store, name, reader, host, process_group, options)
    except (CorruptCheckpointError, CheckpointReadError) as e:
        placed = getattr(reader, "tensors_placed", 0)
        if options.mode != PLACE or not placed:
            raise
        raise type(e)(
            f"{e}. {placed} tensor(s) of the objects being loaded were being read into, or had been, before this: they are "
            "partly overwritten, so load a checkpoint into them again before training on"
        ) from (e.__cause__ or e)


def _read_into(
    store: CheckpointStore,
    name: str,
    reader: Any,
    host: dict[str, Any],
    process_group: Any,
    options: ReadOptions,
) -> dict[str, FileIdentity]:
    import torch.distributed.checkpoint as dcp

    where = store.checkpoint_url(name)
    expect = getattr(reader, "expect", None)
    manifest = options.manifest
    if expect is not None:  # each blob read once, on several threads; checked as it arrives with a manifest
        expected = None if manifest is None else ExpectedSums.from_manifest(manifest, where, options.signing_key)
        expect(expected, mode=options.mode, checked_files=options.checked_files)
    elif manifest is not None or options.mode != ADOPT:
        raise ConfigError(
            f"{type(store).__name__}.make_reader returned a {type(reader).__name__}, which cannot check blobs as it "
            "reads; build it with format.blob_reader.verified_reader_class, or load with verify=False"
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
    return dict(getattr(reader, "files_read", {}))


def empty_like_on_cpu(value: Any) -> Any:
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
        return {k: empty_like_on_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [empty_like_on_cpu(v) for v in value]
    return value


def world_of(process_group: Any) -> tuple[Any, int, int]:
    """(the group to load with, or None in one process; this rank; the world size)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size(process_group) > 1:
        return (process_group or dist.group.WORLD), dist.get_rank(process_group), dist.get_world_size(process_group)
    return None, 0, 1


def agree_before_reading(group: Any, error: BaseException | None, name: str | None) -> None:
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
