"""DCP's ``write_data`` for a shard of many small tensors: one loop per file, the same files, offsets and results.

Runs in the writer process, from ``commit_writer.ManifestFirstWriting.write_data``, where
``tensor_blob.install()`` ran. DCP's FileSystemWriter stores each item through
``_write_item``: a wrapper class defined anew for every call (``transform_save_stream``),
``torch.save`` into it (answered from a template by ``tensor_blob.py``), then a flush,
which for a local file is one ``write`` system call per item. For 30,000 tensors of 64
bytes those per-item costs were most of the commit's write phase
(``benchmarks/many_tensors.py``).

Here each file's tensors go straight into the checksumming stream: a templated blob is one
``write`` between two ``tell()`` calls (one checksummed span, as before), and nothing is
flushed until the file's fsync. Anything else, a BYTE_IO item or a tensor no template
serves, goes through DCP's own ``_write_item``, unchanged. The files are DCP's: the same
buckets (``_split_by_size_and_type``), names, item order (sorted by size where DCP's
one-thread loader sorts them, on a machine with an accelerator) and ``_StorageInfo``, so
``.metadata`` records them as DCP would and stock ``dcp.load`` reads them.

Used only where this torch's writer is the one this was written against (DCP's helpers
found by name, no stream transforms, torch.save serialization, one file per thread);
anywhere else DCP writes as it always did.
"""

from __future__ import annotations

import inspect
import os
import threading
from io import UnsupportedOperation
from typing import Any

import torch
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from . import tensor_blob


def _dcp_helpers() -> dict[str, Any] | None:
    """DCP's own pieces this write reuses, or None where this torch's module does not have them as expected."""
    helpers: dict[str, Any] = {
        name: getattr(dcp_filesystem, name, None)
        for name in ("_split_by_size_and_type", "_StorageInfo", "_write_item", "_item_size", "DEFAULT_SUFFIX")
    }
    if any(v is None for v in helpers.values()):
        return None
    try:
        parameters = list(inspect.signature(helpers["_write_item"]).parameters)
    except (TypeError, ValueError):
        return None
    if parameters[:5] != ["transforms", "stream", "data", "write_item", "storage_key"]:
        return None
    return helpers


_DCP = _dcp_helpers()
_get_crc32_options = getattr(torch.serialization, "get_crc32_options", None)
_set_crc32_options = getattr(torch.serialization, "set_crc32_options", None)
# Templated blobs are handed to the stream in batches of about this many bytes (write_blobs).
BATCH_BYTES = 1 << 20


def applies(writer: Any, plan: Any) -> bool:
    """Whether ``writer`` (a DCP FileSystemWriter) writes ``plan`` as this module does: else DCP's own ``write_data``."""
    if _DCP is None or not tensor_blob.installed():
        return False
    serialization = getattr(writer, "serialization_format", None)
    if serialization is not None and getattr(serialization, "name", None) != "TORCH_SAVE":
        return False  # safetensors: one blob per file, written at the file's end
    transforms = getattr(writer, "transforms", None)
    if transforms is None or getattr(transforms, "extensions", None) != ():
        return False  # a stream transform (compression) wraps each item's bytes
    return bool(getattr(writer, "single_file_per_rank", False)) and isinstance(getattr(plan.storage_data, "prefix", None), str)


def write_data(writer: Any, plan: Any, planner: Any) -> list[WriteResult]:
    """Every item of ``plan`` into ``writer``'s files, one file per bucket and thread as DCP makes them; their results."""
    assert _DCP is not None
    buckets = _DCP["_split_by_size_and_type"](writer.thread_count, plan.items)
    files = []
    for number, bucket in enumerate(buckets):
        name = f"{plan.storage_data.prefix}{number}{_DCP['DEFAULT_SUFFIX']}"
        files.append((writer.fs.concat_path(writer.path, name), name, bucket))
    results: list[list[WriteResult]] = [[] for _ in files]
    failures: list[BaseException] = []
    # torch keeps the zip-CRC option per thread: the writer turned it off in its main thread
    # (writer/process.py), and each file's thread saves as that thread does, templates included.
    crc = _get_crc32_options() if _get_crc32_options is not None else None

    def write(i: int) -> None:  # a file of another thread than the caller's
        try:
            if crc is not None and _set_crc32_options is not None:
                _set_crc32_options(crc)
            results[i] = _write_file(writer, planner, *files[i])
        except BaseException as e:  # noqa: BLE001 - raised in the caller's thread below
            failures.append(e)

    threads: list[threading.Thread] = []
    try:
        for i in range(1, len(files)):
            thread = threading.Thread(target=write, args=(i,), name="overlapckpt-shard-write")
            thread.start()
            threads.append(thread)
        if files:
            results[0] = _write_file(writer, planner, *files[0])  # this thread's own error raises as it is
    finally:
        for thread in threads:  # every file closed before anything is reported
            thread.join()
    if failures:
        raise failures[0]
    return [r for file_results in results for r in file_results]


def _orders_by_size(writer: Any) -> bool:
    """Whether DCP's own write orders each file's tensors by size, smallest first: with one thread where a CUDA
    (or other accelerator) device is available, its ``_OverlappingCpuLoader`` sorts them so."""
    if writer.thread_count != 1 or getattr(writer, "per_thread_copy_ahead", 0) <= 0:
        return False
    backend = getattr(torch, torch._C._get_privateuse1_backend_name(), None)
    return bool(torch.cuda.is_available() or (backend is not None and backend.is_available()))


def _write_file(writer: Any, planner: Any, path: Any, storage_key: str, items: list[Any]) -> list[WriteResult]:
    """One shard file: its BYTE_IO items, then its tensors, then the fsync, as DCP's ``_write_files_from_queue``."""
    assert _DCP is not None
    serialization = getattr(writer, "serialization_format", None)
    dcp_item_args = (serialization,) if serialization is not None else ()
    results: list[WriteResult] = []
    with writer.fs.create_stream(path, "wb") as stream:
        batch = _Batch(stream, storage_key, results)
        for item in items:
            if item.type == WriteItemType.BYTE_IO:
                results.append(_DCP["_write_item"](writer.transforms, stream, planner.resolve_data(item), item, storage_key, *dcp_item_args))
        tensor_items = [item for item in items if item.type != WriteItemType.BYTE_IO]
        if getattr(planner, "before_reading", None) is not None:
            # A pipelined snapshot: its tensors land in slot order, and are written so (writer/slot_landing.py).
            tensor_items.sort(key=planner.slot_order)
        elif _orders_by_size(writer):
            tensor_items.sort(key=_DCP["_item_size"])  # stable, as DCP's loader sorts them: the same file
        for item in tensor_items:
            tensor = planner.resolve_data(item).detach().cpu()
            if tensor.untyped_storage().size() != tensor.nbytes:
                tensor = tensor.clone()  # minimal storage, as DCP's loader makes it (torch.save writes the whole storage)
            blob = tensor_blob.template_blob(tensor, stream)
            if blob is None:
                batch.write()  # the file's bytes stay in item order
                results.append(_DCP["_write_item"](writer.transforms, stream, tensor, item, storage_key, *dcp_item_args))
            else:
                batch.add(item, blob)
        batch.write()
        stream.flush()  # DCP's last item flushed on its close; here, the file's one flush before its fsync
        if writer.sync_files:
            try:
                os.fsync(stream.fileno())
            except (AttributeError, UnsupportedOperation):
                os.sync()  # a stream without a descriptor, as DCP does
        stream.close()
    return results


class _Batch:
    """Templated blobs waiting to go to the stream together, up to ``BATCH_BYTES``: one write for many items."""

    def __init__(self, stream: Any, storage_key: str, results: list[WriteResult]) -> None:
        self.stream = stream
        self.storage_key = storage_key
        self.results = results
        self.together = bool(getattr(stream, "writes_blobs_together", False))
        self.items: list[Any] = []
        self.blobs: list[bytes] = []
        self.nbytes = 0

    def add(self, item: Any, blob: bytes) -> None:
        if not self.together:  # a signing key: each blob's MAC is taken as it is written
            offset = self.stream.tell()  # the span before closes here: each blob is checksummed on its own
            tensor_blob.write_fully(self.stream, blob)
            self._result(item, offset, self.stream.tell() - offset)
            return
        self.items.append(item)
        self.blobs.append(blob)
        self.nbytes += len(blob)
        if self.nbytes >= BATCH_BYTES:
            self.write()

    def write(self) -> None:
        if not self.blobs:
            return
        for item, (offset, length) in zip(self.items, self.stream.write_blobs(self.blobs)):
            self._result(item, offset, length)
        self.items, self.blobs, self.nbytes = [], [], 0

    def _result(self, item: Any, offset: int, length: int) -> None:
        assert _DCP is not None
        self.results.append(WriteResult(index=item.index, size_in_bytes=length, storage_data=_DCP["_StorageInfo"](self.storage_key, offset, length)))
