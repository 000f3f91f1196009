"""The snapshot's per-entry checksums, its large entries hashed on a thread while DCP writes them.

Runs in the writer process, once per persist, over the host slot as replayed. Each entry's
checksum goes into the manifest (a load checks what DCP decodes against it), and DCP's
stream takes a large entry's from here instead of hashing its bytes again
(``format/known_sums.py``). Hashing the whole snapshot before the write put a pass over
every byte ahead of it: 0.07 s of a 768 MiB persist's 0.46 s on tmpfs, where the write
itself took 0.26 s (``benchmarks/results/limits/durable/durable.md``). CRC-32C releases
the GIL, so a thread hashes the large entries while the write runs, and a write that
reaches an entry before the thread waits for that entry alone. Small entries are hashed
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

# Entries of at least this many bytes are hashed on the thread (the known-sum threshold: a
# smaller write is hashed by the stream anyway).
THREADED_MIN_BYTES = KNOWN_SUM_MIN_BYTES


class SnapshotChecksums:
    """Each entry's checksum (8 hex digits), by entry index: the small ones at once, the large ones as the thread gets to them."""

    def __init__(self, slot: torch.Tensor, nbytes: Sequence[int], offsets: Sequence[int], algorithm: str) -> None:
        update = updater(algorithm)
        mapped: Any = slot.numpy() if slot.numel() else b""  # the slot's bytes (uint8), shared with it
        # One buffer over the whole slot, sliced per entry: a ctypes array per tensor cost 8 us each,
        # 0.3 s of a persist at 40,000 tensors (2-core VM).
        self._data = memoryview(mapped)
        self._spans = list(zip(offsets, nbytes))
        self._sums: list[str | None] = [
            hex32(update(self._data[off : off + n], 0)) if n < THREADED_MIN_BYTES else None for off, n in self._spans
        ]
        self._large = [i for i, s in enumerate(self._sums) if s is None]
        self._ready = threading.Condition()
        self._failure: BaseException | None = None
        self._stopping = False
        self._thread: threading.Thread | None = None
        if self._large:
            self._thread = threading.Thread(target=self._hash_large, args=(update,), name="overlapckpt-snapshot-sums", daemon=True)
            self._thread.start()

    def _hash_large(self, update: Any) -> None:
        try:
            for i in self._large:
                if self._stopping:
                    return
                off, n = self._spans[i]
                checksum = hex32(update(self._data[off : off + n], 0))  # the GIL is released while it hashes
                with self._ready:
                    self._sums[i] = checksum
                    self._ready.notify_all()
        except BaseException as e:  # noqa: BLE001 - raised in every waiter
            with self._ready:
                self._failure = e
                self._ready.notify_all()

    def of(self, index: int) -> str:
        """Entry ``index``'s checksum, waiting for the thread where it has not hashed it yet."""
        checksum = self._sums[index]
        if checksum is not None:
            return checksum
        with self._ready:
            while self._sums[index] is None:
                if self._failure is not None:
                    raise InternalError(f"hashing the snapshot failed: {type(self._failure).__name__}: {self._failure}") from self._failure
                if self._stopping or self._thread is None:
                    raise InternalError("the snapshot's checksums were asked for after the persist closed them")
                self._ready.wait()
            return self._sums[index]  # type: ignore[return-value]

    def all(self) -> list[str]:
        """Every entry's checksum, in entry order (waits for the thread's)."""
        return [self.of(i) for i in range(len(self._sums))]

    def close(self) -> None:
        """Stop and join the thread: no read of the slot outlives the persist."""
        self._stopping = True
        if self._thread is not None:
            self._thread.join()
