"""A tensor's blob as DCP stores it (``torch.save`` of one tensor: a zip), decoded in place: the tensor is a view of the bytes read.

``torch.load`` on a blob copies the tensor's bytes out of it into a new storage. Here
the zip's directory is read (plain structure, no pickle) to find where the tensor's
raw bytes lie, so that a load can check them against the manifest before anything
is unpickled, and ``data.pkl`` is then unpickled with torch's weights-only unpickler,
its one storage being the bytes already read. One read, no copy.

A large blob can also be located from its two ends only (``locate_from_ends``): the
framing before the data and the zip directory after it. A load then reads the data
straight into the tensor it restores, and never holds the blob in a buffer of its own
(``blob_reader.py``); ``decode_meta`` says what that tensor must be (dtype, shape),
without any of its bytes.

Anything else than the plain form torch.save writes for one tensor (compression, more
than one storage, big-endian data) returns None, and the caller uses ``torch.load``.
"""

from __future__ import annotations

import io
import struct
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")  # a zip local file header: 30 bytes, then the name and extra field
_LOCAL_SIGNATURE = b"PK\x03\x04"


class Bytes(Protocol):
    """What ``locate`` reads a blob through: its length, and its bytes by slice."""

    def __len__(self) -> int: ...

    def __getitem__(self, span: slice, /) -> Any: ...


class BlobEnds:
    """A blob of ``length`` bytes of which only the first ``len(head)`` and the last ``len(tail)`` were read.

    A slice inside either end is served; one reaching into the middle raises ValueError,
    which ``locate`` takes as "not the plain form" (the caller then reads the whole blob).
    """

    def __init__(self, head: memoryview, tail: memoryview, length: int) -> None:
        self.head, self.tail, self.length = head, tail, length
        self.tail_start = length - len(tail)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, span: slice) -> memoryview:
        start, stop, _ = span.indices(self.length)
        stop = max(start, stop)
        if stop <= len(self.head):
            return self.head[start:stop]
        if start >= self.tail_start:
            return self.tail[start - self.tail_start : stop - self.tail_start]
        raise ValueError(f"bytes {start}..{stop} of the blob lie between its two ends, which are all that was read")


class ViewReader(io.RawIOBase):
    """A read-only, seekable file over a memoryview, with no copy of it (``io.BytesIO`` copies a memoryview)."""

    def __init__(self, view: Bytes) -> None:
        self._view = view
        self._position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: len(self._view)}[whence]
        self._position = max(0, base + offset)
        return self._position

    def tell(self) -> int:
        return self._position

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        n = max(0, min(len(out), len(self._view) - self._position))
        out[:n] = self._view[self._position : self._position + n]
        self._position += n
        return n


@dataclass(frozen=True)
class TensorRecord:
    """Where the raw bytes of the one storage lie in the blob."""

    data_start: int
    data_end: int
    pickle_bytes: bytes  # data.pkl: what the tensor is (dtype, shape, strides), read from the zip


def locate(view: Bytes) -> TensorRecord | None:
    """The record's layout, from the zip's directory only; None if it is not torch.save's plain form of one tensor.

    Members are read through their local headers, not ``ZipFile.read``: the writer turns
    torch.save's zip CRCs off (the blob checksums cover these bytes), and zipfile would
    refuse the zeros.
    """
    try:
        with zipfile.ZipFile(ViewReader(view)) as archive:
            infos = archive.infolist()
    except (zipfile.BadZipFile, ValueError, OSError, EOFError):
        return None
    data = [i for i in infos if "/data/" in i.filename and not i.filename.endswith("/")]
    pickles = [i for i in infos if i.filename.endswith("/data.pkl")]
    orders = [i for i in infos if i.filename.endswith("/byteorder")]
    if len(data) != 1 or len(pickles) != 1 or any(i.compress_type != zipfile.ZIP_STORED for i in infos):
        return None
    try:  # a member outside the bytes read (a blob read at its two ends only): not the plain form
        spans = [_member_span(view, i) for i in (data[0], pickles[0], *orders[:1])]
        if any(span is None for span in spans):
            return None
        (start, end), (pickle_start, pickle_end) = spans[0], spans[1]  # type: ignore[misc]
        if orders:
            order_start, order_end = spans[2]  # type: ignore[misc]
            if bytes(view[order_start:order_end]) != b"little":
                return None
        return TensorRecord(start, end, bytes(view[pickle_start:pickle_end]))
    except ValueError:
        return None


def locate_from_ends(ends: BlobEnds) -> TensorRecord | None:
    """``locate`` from a blob's two ends; None also when the framing before or after the data is not all in them."""
    record = locate(ends)
    if record is None or record.data_start > len(ends.head) or record.data_end < ends.tail_start:
        return None
    return record


def _member_span(view: Bytes, info: zipfile.ZipInfo) -> tuple[int, int] | None:
    """Where a stored member's bytes lie: after its local header, its name and its extra field."""
    header = bytes(view[info.header_offset : info.header_offset + _LOCAL_HEADER.size])
    if len(header) != _LOCAL_HEADER.size:
        return None
    fields = _LOCAL_HEADER.unpack(header)
    if fields[0] != _LOCAL_SIGNATURE:
        return None
    start = info.header_offset + _LOCAL_HEADER.size + fields[9] + fields[10]
    end = start + info.file_size
    return (start, end) if end <= len(view) else None


def decode_in_place(buffer: Any, record: TensorRecord) -> torch.Tensor | None:
    """The tensor, as a view of ``buffer``'s bytes at the record (weights only: no code from the blob runs).

    ``buffer`` must be writable and stay alive as long as the tensor (it does: the tensor
    holds it). None if the pickle is not one plain tensor over exactly that storage.
    """
    view = memoryview(buffer)
    nbytes = record.data_end - record.data_start
    region = (
        torch.frombuffer(view[record.data_start : record.data_end], dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
    )
    tensor = _unpickle_one_tensor(record, lambda: region.untyped_storage())
    if tensor is None or (nbytes and tensor.data_ptr() != region.data_ptr()):
        return None
    return tensor


def decode_meta(record: TensorRecord) -> torch.Tensor | None:
    """What the record's tensor is (dtype, shape, strides), as a tensor on the meta device: none of its bytes are needed."""
    nbytes = record.data_end - record.data_start
    return _unpickle_one_tensor(record, lambda: torch.UntypedStorage(nbytes, device="meta"))


def _unpickle_one_tensor(record: TensorRecord, storage: Callable[[], torch.UntypedStorage]) -> torch.Tensor | None:
    """``data.pkl`` with the weights-only unpickler, its one storage being ``storage()``; None unless one plain tensor over all of it."""
    from torch._weights_only_unpickler import Unpickler

    nbytes = record.data_end - record.data_start
    used: list[Any] = []

    def persistent_load(saved_id: Any) -> Any:
        typename, storage_type, key, _location, numel = saved_id
        dtype = storage_type.dtype
        if typename != "storage" or used or int(numel) * torch._utils._element_size(dtype) != nbytes:
            raise ValueError("not the one storage of this record")
        used.append(key)
        return torch.storage.TypedStorage(wrap_storage=storage(), dtype=dtype, _internal=True)

    unpickler = Unpickler(io.BytesIO(record.pickle_bytes))
    unpickler.persistent_load = persistent_load  # type: ignore[method-assign]
    try:
        tensor = unpickler.load()
    except Exception:
        return None
    if (
        type(tensor) is not torch.Tensor
        or not tensor.is_contiguous()
        or tensor.storage_offset() != 0
        or tensor.numel() * tensor.element_size() != nbytes
    ):
        return None
    return tensor
