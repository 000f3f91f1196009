"""Read committed checkpoints: list them, verify them, restore them in place."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from .errors import CheckpointMismatchError, CheckpointNotFoundError, CorruptCheckpointError, OverlapCkptError
from .extra_state import decode
from .manifest import MANIFEST_NAME, CheckpointInfo, checkpoint_name, parse_manifest, step_of_name, tensor_crc32
from .state import check_shapes, flatten_tensors
from .storage import CheckpointStore


def list_checkpoints(path: str, storage_options: dict[str, Any] | None = None) -> list[CheckpointInfo]:
    """Committed checkpoints under ``path``, oldest first. Uncommitted directories never appear."""
    store = CheckpointStore(path, storage_options)
    out = []
    for name in store.committed_names():
        try:
            manifest = read_manifest(store, name)
        except (OverlapCkptError, OSError) as e:
            warnings.warn(f"overlapckpt: skipping {store.checkpoint_url(name)}: {e}", stacklevel=2)
            continue
        out.append(CheckpointInfo.from_manifest(manifest, store.checkpoint_url(name)))
    return out


def resolve_checkpoint(store: CheckpointStore, step: int | None) -> str:
    """The directory name of the requested committed checkpoint (the newest when ``step`` is None)."""
    names = store.committed_names()
    if not names:
        raise CheckpointNotFoundError(
            f"no committed checkpoint under {store.root!r}; check the path, or wait for a checkpoint to commit "
            "(a directory counts once its .metadata exists)"
        )
    if step is None:
        latest = store.read_latest()
        return latest if latest in names else names[-1]
    name = checkpoint_name(step)
    if name not in names:
        steps = [step_of_name(n) for n in names]
        raise CheckpointNotFoundError(
            f"no committed checkpoint of step {step} under {store.root!r}; committed steps are {steps}"
        )
    return name


def read_manifest(store: CheckpointStore, name: str) -> dict[str, Any]:
    """The manifest of committed checkpoint ``name``; CorruptCheckpointError if it is missing or unreadable."""
    where = store.checkpoint_url(name)
    try:
        raw = store.read_bytes(name, MANIFEST_NAME)
    except FileNotFoundError as e:
        raise CorruptCheckpointError(f"{where} is committed but has no {MANIFEST_NAME}; it was not written by overlapckpt") from e
    return parse_manifest(raw, f"{where}/{MANIFEST_NAME}")


def read_into(store: CheckpointStore, name: str, host: dict[str, Any]) -> None:
    """Fill host tensors from checkpoint ``name`` with DCP; CorruptCheckpointError if it cannot be read."""
    import torch.distributed.checkpoint as dcp

    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            dcp.load(host, storage_reader=store.make_reader(name), no_dist=True)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # DCP's CheckpointException derives from BaseException
        where = store.checkpoint_url(name)
        raise CorruptCheckpointError(f"reading the checkpoint {where} failed: {type(e).__name__}: {e}") from e


def _empty_like_on_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        local = value.to_local() if callable(getattr(value, "to_local", None)) else value
        return torch.empty(local.shape, dtype=local.dtype, device="cpu")
    if isinstance(value, dict):
        return {k: _empty_like_on_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_empty_like_on_cpu(v) for v in value]
    return value


def load(
    path: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    stateful: dict[str, Any] | None = None,
    step: int | None = None,
    storage_options: dict[str, Any] | None = None,
    verify: bool = True,
) -> CheckpointInfo:
    """Restore a committed checkpoint in place: model, optimizer, stateful objects and RNG states.

    ``step=None`` loads the newest committed checkpoint. The checkpoint is read into
    host memory and checked first (shapes, then per-item checksums when ``verify``),
    so a mismatched or corrupt checkpoint raises before any live object changes.
    """
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


    store = CheckpointStore(path, storage_options)
    name = resolve_checkpoint(store, step)
    where = store.checkpoint_url(name)
    manifest = read_manifest(store, name)

    if optimizer is not None:
        msd, osd = get_state_dict(model, optimizer)
        target = {"model": msd, "optimizer": osd}
    else:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        target = {"model": get_model_state_dict(model)}
    expected = {k: tuple(v["shape"]) for k, v in manifest["items"].items()}
    check_shapes(expected, flatten_tensors(target))

    host = _empty_like_on_cpu(target)
    read_into(store, name, host)
    if verify:
        for key, t in flatten_tensors(host).items():
            item = manifest["items"].get(key)
            if item is not None and tensor_crc32(t) != int(item["crc32"]):
                raise CorruptCheckpointError(
                    f"checksum mismatch for {key!r} in {where}: the stored bytes differ from what was "
                    "saved; restore from an older checkpoint (list_checkpoints) or pass verify=False to inspect it"
                )

    extra = decode(manifest.get("extra_state", {}))
    _check_stateful_names(extra, stateful or {}, where)
    if optimizer is not None:
        set_state_dict(model, optimizer, model_state_dict=host["model"], optim_state_dict=host["optimizer"])
    else:
        model.load_state_dict(host["model"])
    _restore_extra_state(extra, stateful or {})
    return CheckpointInfo.from_manifest(manifest, where)


def _check_stateful_names(extra: dict[str, Any], stateful: dict[str, Any], where: str) -> None:
    saved = extra.get("stateful", {})
    missing = [name for name in stateful if name not in saved]
    if missing:
        raise CheckpointMismatchError(
            f"stateful objects {missing} are not in {where}, which holds {sorted(saved)}; pass the same "
            "stateful names that were saved"
        )


def _restore_extra_state(extra: dict[str, Any], stateful: dict[str, Any]) -> None:
    saved = extra.get("stateful", {})
    for name, obj in stateful.items():
        obj.load_state_dict(saved[name])
    rng = extra.get("rng", {})
    if "torch_cpu" in rng:
        torch.set_rng_state(rng["torch_cpu"])
    cuda_states = rng.get("torch_cuda")
    if cuda_states and torch.cuda.is_available() and len(cuda_states) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda_states)
