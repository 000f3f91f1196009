"""Reading a large tensor's bytes from its blob straight into the tensor a load restores: no buffer of the blob's own.

Runs in the process that loads. A fresh buffer per blob costs a page fault per 4 KiB
the first time it is written: for 768 MiB of state, about 196,000 faults, half a
second on a 2-core VM, and whether the allocator hands out fresh or reused memory
changes from one load to the next (glibc raises its mmap threshold after a free), so
the load time was bimodal (docs/benchmarks.md, "Loading"). The tensor being restored
is already in memory: its pages were faulted in when it was built. Reading into it
faults nothing.

Only the blob's two ends are read into a small buffer: torch.save's framing before the
data (the zip's local headers and ``data.pkl``) and after it (the zip's directory).
They say where the data lies and what tensor it is (``tensor_decode.py``); the data
then goes into the target with one ``readinto``.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from .tensor_decode import BlobEnds

# A blob shorter than this is read whole into the reading thread's buffer (its pages are
# faulted in once per thread): reading its two ends apart would cost more than it saves.
DIRECT_MIN_BYTES = 1 << 20
# How much of each end is read: torch.save's framing of one tensor is under 1 KiB before
# the data and under 1 KiB after it; the rest is slack for long key names.
ENDS_BYTES = 16 << 10


def fill(stream: Any, view: memoryview) -> int:
    """Read ``stream`` into ``view`` until it is full or the stream ends; the bytes read."""
    readinto = getattr(stream, "readinto", None)
    if readinto is None:  # a stream without readinto (some fsspec files): one copy more
        data = stream.read(len(view))
        view[: len(data)] = data
        return len(data)
    filled = 0
    while filled < len(view):
        n = readinto(view[filled:])
        if not n:
            break
        filled += n
    return filled


def read_ends(stream: Any, offset: int, length: int) -> BlobEnds | None:
    """The first and last ``ENDS_BYTES`` of the blob at ``offset``; None if the stream ends first."""
    span = min(ENDS_BYTES, length)
    head, tail = bytearray(span), bytearray(span)
    stream.seek(offset)
    if fill(stream, memoryview(head)) != span:
        return None
    stream.seek(offset + length - span)
    if fill(stream, memoryview(tail)) != span:
        return None
    return BlobEnds(memoryview(head), memoryview(tail), length)


def takes_data_as_is(target: torch.Tensor, saved: torch.Tensor) -> bool:
    """The stored data (``saved``: its meta tensor) can be read into ``target``'s memory byte for byte."""
    return (
        type(target) is torch.Tensor
        and target.device.type == "cpu"
        and target.is_contiguous()
        and not target.is_conj()
        and not target.is_neg()
        and target.dtype == saved.dtype
        and tuple(target.shape) == tuple(saved.shape)
        and target.numel() > 0
    )


def tensor_bytes(target: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's memory as a writable byte view (the tensor must outlive it)."""
    nbytes = target.numel() * target.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(target.data_ptr())).cast("B")


def mark_written(target: torch.Tensor) -> None:
    """Bump ``target``'s autograd version counter, as an in-place op does (its bytes were written through memory)."""
    increment = getattr(torch.autograd.graph, "increment_version", None)
    if increment is not None:
        increment(target)
