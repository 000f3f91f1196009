"""A small tensor's blob recognised by its framing, compared byte for byte with torch.save's own: nothing of it is parsed.

Runs in the process that loads, on the reader's threads. The general way to decode a blob
(``tensor_decode.py``) reads its zip directory and unpickles its ``data.pkl`` with the
weights-only unpickler: about a fifth of a millisecond a blob, which for a state of 30,000
small tensors was most of a verified load, twice (the load's check pass and its placing
pass each decode every blob).

But the blob overlapckpt's writer stores for a tensor is torch.save's output with the zip
CRCs off (``writer/process.py``), and that depends on the tensor's data only in its data
record (``tensor_blob.py`` writes it from a template for that reason). So given the dtype
and shape ``.metadata`` gives the blob's chunk, the bytes before and after the data are
known: this module makes them, by torch.save of a tensor of that dtype and shape, and
compares the blob's with them. A blob equal to them is exactly what torch.save writes for
a tensor of that dtype and shape holding its data bytes, so it decodes to that tensor, a
view of the bytes read, with nothing of the blob parsed; what ``.metadata`` claims only
chooses what the blob is compared with. Anything else (another torch's framing, CRCs on,
a blob crafted to look like one) goes the general way.
"""

from __future__ import annotations

import io
import threading
from typing import Any

import torch

from .tensor_decode import locate

# Blobs whose data is at most this long are recognised here: above it the framing is a
# small part of the blob's cost, and making a framing allocates a tensor of that size.
KNOWN_FRAMING_MAX_BYTES = 1 << 20
# Framings kept per process, one per (dtype, shape): a state has a few shapes, many times
# over; a .metadata that names more (crafted, or a model of many shapes) decodes the rest
# the general way instead of growing this without bound.
MAX_FRAMINGS = 4096

# What .metadata gives a tensor chunk: its dtype and shape.
StoredAs = tuple[torch.dtype, tuple[int, ...]]

_get_crc32_options = getattr(torch.serialization, "get_crc32_options", None)
_set_crc32_options = getattr(torch.serialization, "set_crc32_options", None)


class _Framing:
    __slots__ = ("prefix", "suffix", "data_nbytes")

    def __init__(self, prefix: bytes, suffix: bytes, data_nbytes: int) -> None:
        self.prefix, self.suffix, self.data_nbytes = prefix, suffix, data_nbytes


class KnownFramings:
    """torch.save's framing (the bytes before and after the data) of a plain tensor, per (dtype, shape), made once each."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._framings: dict[tuple[torch.dtype, tuple[int, ...]], _Framing | None] = {}

    def tensor(self, buffer: Any, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor | None:
        """The tensor, when ``buffer`` is torch.save's blob of a ``dtype`` tensor of ``shape``; None when it is anything else.

        The tensor is a view of ``buffer`` (writable, alive as long as the tensor). None too
        where the framing cannot be known here (past ``KNOWN_FRAMING_MAX_BYTES``, an old torch).
        """
        framing = self._framing(dtype, shape)
        if framing is None:
            return None
        view = memoryview(buffer)
        start, end = len(framing.prefix), len(framing.prefix) + framing.data_nbytes
        if len(view) != end + len(framing.suffix) or view[:start] != framing.prefix or view[end:] != framing.suffix:
            return None
        return torch.frombuffer(view[start:end], dtype=dtype).view(shape)

    def _framing(self, dtype: torch.dtype, shape: tuple[int, ...]) -> _Framing | None:
        key = (dtype, shape)
        with self._lock:
            if key in self._framings:
                return self._framings[key]
        framing = _made_framing(dtype, shape)
        with self._lock:
            if len(self._framings) < MAX_FRAMINGS:
                self._framings[key] = framing
        return framing


_crc_switch = threading.Lock()  # torch's CRC option is one for the process: one framing is made at a time


def _made_framing(dtype: torch.dtype, shape: tuple[int, ...]) -> _Framing | None:
    """torch.save's bytes around the data of a contiguous ``dtype`` tensor of ``shape``, with the zip CRCs off as the writer saves."""
    if _get_crc32_options is None or _set_crc32_options is None or not isinstance(dtype, torch.dtype):
        return None  # a torch without the switch: its blobs carry CRCs of their data, and no framing is fixed
    numel = 1
    for size in shape:
        if not isinstance(size, int) or size < 0:
            return None
        numel *= size
    data_nbytes = numel * dtype.itemsize
    if data_nbytes == 0 or data_nbytes > KNOWN_FRAMING_MAX_BYTES:
        return None
    sample = torch.zeros(shape, dtype=dtype)
    out = io.BytesIO()
    with _crc_switch:
        # The process's setting, switched for this one save and put back: a blob the writer
        # stored was saved with it off, and a framing made with it on would match nothing.
        crc_was = _get_crc32_options()
        _set_crc32_options(False)
        try:
            torch.save(sample, out)
        finally:
            _set_crc32_options(crc_was)
    blob = out.getvalue()
    record = locate(memoryview(blob))  # torch.save's own bytes, made here: trusted
    if record is None or record.data_end - record.data_start != data_nbytes:
        return None
    return _Framing(blob[: record.data_start], blob[record.data_end :], data_nbytes)


def stored_chunk(metadata: Any, index: Any) -> StoredAs | None:
    """(dtype, shape) that ``.metadata`` gives the tensor chunk at ``index`` (a MetadataIndex); None where it gives none.

    Used only to choose the framing a blob is compared with: a wrong claim matches nothing.
    """
    entry = getattr(metadata, "state_dict_metadata", {}).get(index.fqn)
    chunks = getattr(entry, "chunks", None)
    properties = getattr(entry, "properties", None)
    if not chunks or properties is None:
        return None
    offset = tuple(index.offset) if index.offset is not None else (0,) * len(chunks[0].sizes)
    hinted = index.index
    candidates = [chunks[hinted]] if isinstance(hinted, int) and 0 <= hinted < len(chunks) else []
    for chunk in candidates + list(chunks):
        if tuple(chunk.offsets) == offset:
            return properties.dtype, tuple(int(s) for s in chunk.sizes)
    return None


known_framings = KnownFramings()
