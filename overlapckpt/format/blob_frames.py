"""A load's small tensor blobs, located and decoded once per frame: the same answers as ``tensor_decode``, without its per-blob parse.

A blob is ``torch.save`` of one tensor: its data, inside a frame (the pickle, the zip's
headers, its directory). ``tensor_decode.locate`` reads the frame's zip directory (about
30 us a blob) and ``decode_in_place`` unpickles its ``data.pkl`` with torch's weights-only
unpickler (about 55 us). A checkpoint of many small tensors holds few distinct frames:
the writer's blobs of one dtype, shape and stride differ only in their data
(``tensor_blob.py``). At 30,000 tensors the two came to about 3.4 s a pass of a load.

What is reused is a function of the frame's bytes only. ``locate`` reads nothing but the
frame: the end record at the blob's last 22 bytes, the directory before it, and the local
headers before the data. So a blob whose bytes before and after its data span equal,
byte for byte, those of a blob already located has the same record; and the same
``data.pkl``, so the same tensor (dtype, shape, strides) over its own data. A frame is
kept only when its zip's end record is the blob's last 22 bytes (no archive comment, as
torch.save writes it): otherwise the directory's search would read into the data.

The data itself is never reused: each blob's bytes are checked by the caller as before,
and the tensor is a view of its own bytes. Anything not kept (another frame, a tensor
with ``requires_grad`` or a conjugate or negative bit, no bytes) takes ``tensor_decode``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from .tensor_decode import TensorRecord, decode_in_place, locate

_END_RECORD_SIZE = 22  # a zip's end of central directory record, with no comment
_END_RECORD_SIGNATURE = b"PK\x05\x06"
# Frames kept per process: a checkpoint holds a few per dtype and shape. Past this, afresh.
MAX_FRAMES = 4096


@dataclass
class _Frame:
    prefix: bytes  # the blob before its data span
    suffix: bytes  # and after it
    record: TensorRecord
    # After its first decode: (dtype, shape, stride) of its tensor, or None: decode each time.
    recipe: tuple[torch.dtype, tuple[int, ...], tuple[int, ...]] | None = None
    decoded: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


def _ends_with_a_plain_end_record(view: memoryview) -> bool:
    end = bytes(view[-_END_RECORD_SIZE:])
    return len(end) == _END_RECORD_SIZE and end[:4] == _END_RECORD_SIGNATURE and end[-2:] == b"\x00\x00"


class BlobFrames:
    """The frames seen so far, by blob length; each with its record and, once decoded, its tensor's recipe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # DCP reads on several threads
        self._by_length: dict[int, list[_Frame]] = {}
        self._by_record: dict[int, _Frame] = {}  # id(record): the frame holds the record, so the id stays its
        self._count = 0

    def locate(self, view: memoryview) -> TensorRecord | None:
        """``tensor_decode.locate(view)``; a kept frame's record when the blob's frame is byte for byte that frame."""
        with self._lock:
            candidates = list(self._by_length.get(len(view), ()))
        for frame in candidates:
            kept = frame.record
            if view[: kept.data_start] == frame.prefix and view[kept.data_end :] == frame.suffix:
                return kept
        record = locate(view)
        if record is not None and _ends_with_a_plain_end_record(view):
            frame = _Frame(bytes(view[: record.data_start]), bytes(view[record.data_end :]), record)
            with self._lock:
                if self._count >= MAX_FRAMES:
                    self._by_length.clear()
                    self._by_record.clear()
                    self._count = 0
                self._by_length.setdefault(len(view), []).append(frame)
                self._by_record[id(record)] = frame
                self._count += 1
        return record

    def decode_in_place(self, buffer: Any, record: TensorRecord) -> torch.Tensor | None:
        """``tensor_decode.decode_in_place``; for a kept frame decoded before, the same tensor built over this blob's data."""
        with self._lock:
            frame = self._by_record.get(id(record))
        if frame is None or frame.record is not record or record.data_end == record.data_start:
            return decode_in_place(buffer, record)
        with frame.lock:
            if not frame.decoded:
                tensor = decode_in_place(buffer, record)
                frame.decoded = True
                if tensor is not None and not (tensor.requires_grad or tensor.is_conj() or tensor.is_neg()):
                    frame.recipe = (tensor.dtype, tuple(tensor.shape), tensor.stride())
                return tensor
        if frame.recipe is None:
            return decode_in_place(buffer, record)
        dtype, shape, stride = frame.recipe
        region = torch.frombuffer(memoryview(buffer)[record.data_start : record.data_end], dtype=torch.uint8)
        return torch.empty(0, dtype=dtype).set_(region.untyped_storage(), 0, shape, stride)
