"""Checksums the writer already holds for memory DCP is about to store: each stored byte is hashed once.

The writer checksums every tensor of its host snapshot (the manifest's per-item
checksum, which a load checks against what DCP decodes). DCP then stores the same
memory: ``torch.save`` hands a tensor's storage to the stream in one ``write``, from the
tensor's own address (``hostbuf.exact_view`` keeps DCP from cloning it). Hashing those
bytes again for the blob's checksum was a second pass over the whole state: 55 ms of a
768 MiB save's 0.47-0.78 s (``benchmarks/durable.py``, 2-core VM).

A write whose buffer is exactly such a tensor (same address, same length) takes its
known checksum, and ``ChecksummingStream`` combines it into the running span
(``crc_combine.py``) instead of hashing. Anything else (framing, a clone, a part of a
tensor, a tensor too small to be worth it) is hashed as before.

What this trusts: the slot is not written between its snapshot checksum and its
store, which the slot protocol guarantees (the trainer writes a slot only after the
writer hands it back). Were it broken, the stored blob's checksum (the snapshot's)
would not match its bytes, and a verified load refuses the blob: nothing is hidden.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy
import torch

from .checksum import Updater
from .crc_combine import combine

# Below this a write is hashed: combining costs tens of microseconds of Python, hashing
# 1 MiB about 100 us at hardware CRC32C speed.
KNOWN_SUM_MIN_BYTES = 1 << 20


def buffer_address(view: memoryview) -> int:
    """The address of a C-contiguous buffer's first byte (read-only buffers too, which ctypes refuses)."""
    return int(numpy.frombuffer(view, dtype=numpy.uint8).ctypes.data)


class KnownChecksums:
    """Checksums of whole tensors in memory, by (address, length): the write stream's shortcut."""

    def __init__(self, algorithm: str) -> None:
        self.algorithm = algorithm
        self._by_span: dict[tuple[int, int], int | Callable[[], int]] = {}

    def add(self, tensor: torch.Tensor, checksum: int | Callable[[], int]) -> None:
        """``checksum`` is of ``tensor``'s bytes in ``self.algorithm`` (or gives it, once it is known: it may wait).

        Small or strided tensors are skipped.
        """
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes >= KNOWN_SUM_MIN_BYTES and tensor.device.type == "cpu" and tensor.is_contiguous():
            self._by_span[(tensor.data_ptr(), nbytes)] = checksum

    def _known(self, view: memoryview) -> int | Callable[[], int] | None:
        if view.nbytes < KNOWN_SUM_MIN_BYTES or not self._by_span or not view.c_contiguous:
            return None
        return self._by_span.get((buffer_address(view), view.nbytes))

    def holds(self, view: memoryview) -> bool:
        """Whether these bytes are a snapshot tensor's, whose checksum is known or will be (never waits for it)."""
        return self._known(view) is not None

    def checksum_of(self, view: memoryview) -> int | None:
        """The known checksum of exactly these bytes, or None (hash them)."""
        known = self._known(view)
        return known() if callable(known) else known


def extend(update: Updater, algorithm: str, running: int, view: memoryview, known: KnownChecksums | None) -> tuple[int, bool]:
    """The running checksum after ``view``'s bytes, and whether they were hashed (False: a known checksum was combined)."""
    checksum = known.checksum_of(view) if known is not None else None
    if checksum is None:
        return update(view, running), True
    return combine(algorithm, running, checksum, view.nbytes), False

