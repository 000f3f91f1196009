"""No byte from storage runs code: ``.metadata`` through an allowlisting unpickler, byte items as weights only.

A DCP checkpoint holds two kinds of pickle: ``.metadata`` (DCP's ``Metadata``
dataclasses, written by the coordinator) and *byte items* (non-tensor state such as
the optimizer's ``param_groups``, written by ``torch.save``). Stock DCP reads the
first with ``pickle.load`` and the second with ``torch.load(weights_only=False)``:
either runs whatever a crafted file names. Checksums do not help, because an attacker
who can write the files can recompute them (integrity, not authenticity; see the
optional signature in ``signing.py``).

Here ``.metadata`` is unpickled by ``MetadataUnpickler``, which resolves only the
globals DCP's metadata is made of (its dataclasses, ``torch.Size``, dtypes, layouts,
memory formats, paths), and byte items by ``torch.load(weights_only=True)``, torch's
own allowlist of tensors and builtin containers. Anything else is refused with an
``UnsafeCheckpointError`` naming the file and the global. Stock ``dcp.load`` still
reads every checkpoint overlapckpt writes: the files are plain DCP.
"""

from __future__ import annotations

import copy
import io
import pickle
from typing import IO, Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from ..errors import UnsafeCheckpointError
from .pickle_bounds import check_pickle_bounds
from .recent_parses import RecentParses

# Metadata unpickled lately (recent_parses.py), by its bytes: a verified load of a large state reads it twice.
# Two, so that a load beside another (a second root, a tier) keeps its own; each costs its Metadata.
_recent_metadata: RecentParses[Metadata] = RecentParses(entries=2)

_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
# Every global DCP's Metadata pickles, found by unpickling real checkpoints (plain, DTensor
# shards, byte items) under torch 2.11 to 2.13.
_ALLOWED_GLOBALS = {
    (_METADATA_MODULE, name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # looks a torch.layout up by name
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


def _is_torch_constant(module: str, name: str) -> bool:
    """``torch.float32`` and kin: dtypes and memory formats pickle as attributes of ``torch``.

    Looked up in the module's own ``__dict__``: ``getattr(torch, name)`` runs torch's lazy
    ``__getattr__``, which imports a submodule of that name (``torch._inductor``: 217
    modules) before anything could refuse it.
    """
    if module != "torch":
        return False
    value = vars(torch).get(name)
    return isinstance(value, (torch.dtype, torch.memory_format, torch.layout))


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` and nothing else: every other global is refused by name."""

    def __init__(self, file: IO[bytes], where: str) -> None:
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS or _is_torch_constant(module, name):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(
            f"{self.where} names the global {module}.{name}, which DCP's metadata never contains: refused, so that "
            "no code from the checkpoint runs. The file was crafted or is not DCP metadata; do not load it "
            "with stock dcp.load either"
        )


def load_metadata(file: IO[bytes], where: str) -> Metadata:
    """DCP's ``Metadata`` from ``file`` (``where`` names it in errors), never running code from it.

    Its opcodes are scanned first (``pickle_bounds.py``): nothing it claims sizes an allocation.
    The same bytes read again (a verified load reads ``.metadata`` in its check pass and again
    in its placing pass) are not unpickled again: a copy of what they gave is returned, its
    ``storage_meta`` its own (the one field a reader sets; nothing changes the rest).
    """
    data = file.read()
    parsed = _recent_metadata.parsed(None, data, lambda: _unpickled_metadata(data, where))
    metadata = copy.copy(parsed)
    metadata.storage_meta = copy.copy(parsed.storage_meta)
    return metadata


def _unpickled_metadata(data: bytes, where: str) -> Metadata:
    check_pickle_bounds(data, where)
    try:
        metadata = MetadataUnpickler(io.BytesIO(data), where).load()
    except UnsafeCheckpointError:
        raise
    except Exception as e:
        raise UnsafeCheckpointError(f"{where} is not DCP metadata: {type(e).__name__}: {e}") from e
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"{where} holds a {type(metadata).__name__}, not DCP's Metadata")
    return metadata


def load_byte_item(data: io.BytesIO, where: str) -> Any:
    """A byte item (``torch.save`` of non-tensor state) through torch's weights-only unpickler."""
    try:
        return torch.load(data, weights_only=True)
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpointError(
            f"the byte item {where} needs code to unpickle ({e}): refused, so that no code from the checkpoint runs"
        ) from e


def _read_metadata_safely(reader: Any, kwargs: dict[str, Any]) -> Metadata:
    """``read_metadata`` of DCP's FileSystemReader and FsspecReader, with ``load_metadata``."""
    get_path = getattr(reader, "_get_metadata_path", None)
    rank = kwargs.get("rank")
    path = get_path(rank) if callable(get_path) else reader.fs.concat_path(reader.path, ".metadata")
    with reader.fs.create_stream(path, "rb") as f:
        metadata = load_metadata(f, str(path))
    storage_meta = getattr(metadata, "storage_meta", None)
    if storage_meta is None:
        storage_meta = metadata.storage_meta = StorageMeta()
    load_id = getattr(reader, "load_id", None)  # absent from older readers
    if load_id is not None:
        storage_meta.load_id = load_id
    return metadata


def safe_reader_class(base: type) -> type:
    """``base`` (a DCP file-system reader) with ``.metadata`` read by ``load_metadata``."""

    class SafeReader(base):
        _checked_metadata: Metadata | None = None

        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            # Read once, by the caller, before dcp.load: DCP turns an exception raised in
            # here into a string, and the refusal must keep its type.
            if self._checked_metadata is None:
                self._checked_metadata = _read_metadata_safely(self, kwargs)
            return self._checked_metadata

    SafeReader.__name__ = SafeReader.__qualname__ = f"Safe{base.__name__}"
    return SafeReader


SafeFileSystemReader = safe_reader_class(FileSystemReader)


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, with byte items read as weights only."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        loaded = load_byte_item(value, read_item.dest_index.fqn)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


class PlainDataUnpickler(pickle.Unpickler):
    """Unpickles plain data only (dicts, lists, tuples, sets, numbers, strings, bytes): every global is refused.

    For state a framework stores as ``pickle.dumps`` bytes inside a checkpoint (TorchTitan's
    data loader does), which its own ``load_state_dict`` would hand to ``pickle.loads``.
    """

    def __init__(self, file: IO[bytes], where: str) -> None:
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("collections", "OrderedDict"):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(
            f"{self.where} names the global {module}.{name}: refused, so that no code from the checkpoint runs; "
            "only plain data (dicts, lists, tuples, numbers, strings, bytes) is restored from pickled state"
        )


def load_plain_data(data: bytes, where: str) -> Any:
    """``pickle.loads`` of plain data, never running code from it (``where`` names it in errors)."""
    check_pickle_bounds(data, where)
    try:
        return PlainDataUnpickler(io.BytesIO(data), where).load()
    except UnsafeCheckpointError:
        raise
    except Exception as e:
        raise UnsafeCheckpointError(f"{where} is not a plain-data pickle: {type(e).__name__}: {e}") from e
