"""The snapshot's per-entry checksums, its large entries hashed on a thread while DCP writes them.

Runs in the writer process, once per persist, over the host slot as replayed. Each entry's
checksum goes into the manifest (a load checks what DCP decodes against it), and DCP's
stream takes a large entry's from here instead of hashing its bytes again
(``format/known_sums.py``). Hashing the whole snapshot before the write put a pass over
every byte ahead of it: 0.07 s of a 768 MiB persist's 0.46 s on tmpfs, where the write
itself took 0.26 s (``benchmarks/results/limits/durable/durable.md``). CRC-32C releases
the GIL, so a thread hashes the large entries while the write runs; a write that reaches
an entry the thread is hashing waits for that entry alone, and one the thread has not begun
it hashes itself. Small entries are hashed
at once, as before: at 30,000 tensors a thread would only trade the GIL with the write.

The slot may be released once the persist answers, so the thread is always joined
(``close``) before then.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

from ..errors import InternalError
from ..format.checksum import hex32, updater
from ..format.known_sums import KNOWN_SUM_MIN_BYTES
from .slot_landing import SlotLanding

# Entries of at least this many bytes are hashed on the thread (the known-sum threshold: a
# smaller write is hashed by the stream anyway).
THREADED_MIN_BYTES = KNOWN_SUM_MIN_BYTES


class SnapshotChecksums:
    """Each entry's checksum (8 hex digits), by entry index: the small ones at once, the large ones as the thread gets to them."""

    def __init__(
        self, slot: torch.Tensor, nbytes: Sequence[int], offsets: Sequence[int], algorithm: str, landing: SlotLanding | None = None
    ) -> None:
        update = self._update = updater(algorithm)
        mapped: Any = slot.numpy() if slot.numel() else b""  # the slot's bytes (uint8), shared with it
        # One buffer over the whole slot, sliced per entry: a ctypes array per tensor cost 8 us each,
        # 0.3 s of a persist at 40,000 tensors (2-core VM).
        self._data = memoryview(mapped)
        self._spans = list(zip(offsets, nbytes))
        # A pipelined snapshot's entries are hashed once they landed: the large ones by the thread in
        # slot order (the order they land in), the small ones when asked for (by then they landed).
        self.landing = landing
        self._sums: list[str | None] = [
            hex32(update(self._data[off : off + n], 0)) if n < THREADED_MIN_BYTES and landing is None else None
            for off, n in self._spans
        ]
        self._large = sorted((i for i, (off, n) in enumerate(self._spans) if n >= THREADED_MIN_BYTES), key=lambda i: self._spans[i][0])
        self._ready = threading.Condition()
        self._busy: set[int] = set()  # entries being hashed, by the thread or by a caller of of()
        self._failure: BaseException | None = None
        self._stopping = False
        self._thread: threading.Thread | None = None
        if self._large:
            self._thread = threading.Thread(target=self._hash_large, name="overlapckpt-snapshot-sums", daemon=True)
            self._thread.start()

    def _hash_large(self) -> None:
        try:
            for i in self._large:
                with self._ready:
                    if self._stopping:
                        return
                    if self._sums[i] is not None or i in self._busy:  # the write took it already
                        continue
                    self._busy.add(i)
                self._store(i, self._hash(i))
        except BaseException as e:  # noqa: BLE001 - raised in every waiter
            with self._ready:
                self._failure = e
                self._ready.notify_all()

    def _hash(self, index: int) -> str:
        off, n = self._spans[index]
        if self.landing is not None:
            self.landing.wait_for(off + n)
        return hex32(self._update(self._data[off : off + n], 0))  # the GIL is released while it hashes

    def _store(self, index: int, checksum: str) -> None:
        with self._ready:
            self._sums[index] = checksum
            self._busy.discard(index)
            self._ready.notify_all()

    def of(self, index: int) -> str:
        """Entry ``index``'s checksum: hashed here where the thread has not begun it, else waited for.

        The write may reach the entries in another order than the thread: an entry the
        thread has not begun is hashed by the caller (and skipped by the thread), so no
        write waits behind entries it does not need yet.
        """
        checksum = self._sums[index]
        if checksum is not None:
            return checksum
        with self._ready:
            while self._sums[index] is None:
                if self._failure is not None:
                    raise InternalError(f"hashing the snapshot failed: {type(self._failure).__name__}: {self._failure}") from self._failure
                if index not in self._busy:
                    self._busy.add(index)
                    break
                self._ready.wait()
            else:
                return self._sums[index]  # type: ignore[return-value]
        try:
            checksum = self._hash(index)
        except BaseException:
            with self._ready:
                self._busy.discard(index)
                self._ready.notify_all()  # a waiter for this entry hashes it itself, or raises
            raise
        self._store(index, checksum)
        return checksum

    def all(self) -> list[str]:
        """Every entry's checksum, in entry order (waits for the thread's)."""
        return [self.of(i) for i in range(len(self._sums))]

    def close(self) -> None:
        """Stop and join the thread: no read of the slot outlives the persist."""
        self._stopping = True
        if self._thread is not None:
            self._thread.join()
