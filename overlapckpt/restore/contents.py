"""Reading a checkpoint whole into plain host dicts, without the live model or optimizer.

``load`` restores into live objects. A framework's resume path sometimes needs the
checkpoint before those exist: Lightning reads the whole checkpoint (model,
optimizer, loops) before its strategy builds the optimizers. ``read_checkpoint``
builds the tensors to read into from the checkpoint's own ``.metadata`` (read
through the allowlist, ``format/safe_unpickle.py``), then runs the same checks as
``load``: the manifest, every stored byte when ``verify``, the signature with a key,
and each decoded tensor against the snapshot it was saved from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import (
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
)
from ..format.blob_reader import check_data_file, check_span
from ..format.key_layout import GET_STATE_DICT
from ..format.manifest import CheckpointInfo
from ..format.storage import CheckpointStore, translate_read_errors
from ..format.verify import WHOLE_CHECKPOINT, read_manifest
from .check import ManifestChecks, check_signed, checked_manifest, per_rank_extra_state
from .locate import checkpoint_at
from .read import ReadOptions, read_into


@dataclass
class CheckpointContents:
    """What one committed checkpoint holds, in host memory."""

    info: CheckpointInfo
    model: dict[str, torch.Tensor]  # the model's state dict, by fully qualified name
    # torch.distributed.checkpoint.state_dict's form: "state" keyed by parameter name, "param_groups"
    # with parameter names in "params"; optimizer_state_by_index() turns it into torch's own form.
    optimizer: dict[str, Any] | None
    stateful: dict[str, Any] = field(default_factory=dict)  # each stateful object's saved state_dict()
    rng: dict[str, Any] = field(default_factory=dict)  # as saved; restore with loading.restore_rng


def read_checkpoint(
    path: str,
    *,
    step: int | None = None,
    storage_options: dict[str, Any] | None = None,
    verify: bool = True,
    signing_key: str | bytes | None = None,
    rank: int = 0,
) -> CheckpointContents:
    """Read checkpoint ``path`` (a checkpoint directory, or the root: ``step``, else the newest) whole, in this process.

    ``rank`` picks whose stateful objects and RNG states to return from a checkpoint that
    a distributed run wrote (the tensors are the whole, global ones).
    """
    store, name = checkpoint_at(path, step, storage_options)
    where = store.checkpoint_url(name)
    # With a key, authenticity first: nothing of .metadata is decoded before its signature holds.
    manifest = read_manifest(store, name)
    key = check_signed(store, name, manifest, signing_key)
    verify = verify or key is not None  # with a key every blob's MAC is checked (format/blob_macs.py)
    host = _template(store, name)
    manifest = checked_manifest(store, name, manifest, ManifestChecks(WHOLE_CHECKPOINT, "skip", verify), host)
    if manifest.key_layout != GET_STATE_DICT:
        raise ConfigError(
            f"{where} names its state in the {manifest.key_layout!r} key layout, and read_checkpoint returns the "
            f"{GET_STATE_DICT!r} one; restore it with overlapckpt.load (or overlapckpt.titan's manager)"
        )
    read_into(store, name, host, options=ReadOptions(manifest if verify else None, signing_key=key))
    world = manifest.world_size
    if not 0 <= rank < world:
        raise ConfigError(f"rank={rank} is not a rank of {where}, which {world} rank(s) wrote; pass 0..{world - 1}")
    extra = per_rank_extra_state(manifest, rank)
    return CheckpointContents(
        info=CheckpointInfo.from_manifest(manifest, where),
        model=host.get("model", {}),
        optimizer=host.get("optimizer"),
        stateful=dict(extra.get("stateful", {})),
        rng=dict(extra.get("rng", {})),
    )


def _template(store: CheckpointStore, name: str) -> dict[str, Any]:
    """Host tensors shaped as the checkpoint's ``.metadata`` describes, nested as they were saved."""
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    with translate_read_errors(f"{store.checkpoint_url(name)}/.metadata"):
        metadata = store.make_reader(name).read_metadata()
    if metadata is None or not metadata.state_dict_metadata:
        raise CheckpointNotFoundError(f"{store.checkpoint_url(name)} holds no state")
    _check_claimed_sizes(store, name, metadata)
    nested: dict[str, Any] = {}
    planner_data = metadata.planner_data or {}
    for key, item in metadata.state_dict_metadata.items():
        value = torch.empty(tuple(item.size), dtype=item.properties.dtype) if isinstance(item, TensorStorageMetadata) else None
        set_element(nested, planner_data.get(key, (key,)), value)
    return nested


def _check_claimed_sizes(store: CheckpointStore, name: str, metadata: Any) -> None:
    """Before anything is allocated from it: every tensor .metadata describes fits the bytes stored for it.

    A crafted .metadata can claim a 10^15-element tensor; allocated first, that is an
    out-of-memory error or a raw RuntimeError from torch.empty, not a refusal. The blobs'
    lengths are checked against their files' sizes, and each tensor's bytes against the
    blobs stored for it (torch.save's framing only adds to them).
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    where = store.checkpoint_url(name)
    file_nbytes: dict[str, int] = {}
    stored: dict[str, int] = {}
    for index, info in (metadata.storage_data or {}).items():
        relative_path = str(info.relative_path)
        check_data_file(index.fqn, relative_path)
        if relative_path not in file_nbytes:
            with translate_read_errors(f"{where}/{relative_path}"):
                file_nbytes[relative_path] = store.file_size(name, relative_path)
        check_span(relative_path, info, file_nbytes[relative_path])
        stored[index.fqn] = stored.get(index.fqn, 0) + int(info.length)
    for key, item in metadata.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            numel = 1
            for d in item.size:
                numel *= int(d)
            nbytes = numel * torch.empty((), dtype=item.properties.dtype).element_size()
            if nbytes > stored.get(key, 0):
                raise CorruptCheckpointError(
                    f"{where}/.metadata describes {key!r} as {tuple(item.size)} ({nbytes} bytes), but stores "
                    f"{stored.get(key, 0)} bytes for it: the file is damaged or crafted; refused before allocating"
                )
