"""The snapshot's per-entry checksums, its large entries hashed on a thread while DCP writes them.

Runs in the writer process, once per persist, over the host slot as replayed. Each entry's
checksum goes into the manifest (a load checks what DCP decodes against it), and DCP's
stream takes a large entry's from here instead of hashing its bytes again
(``format/known_sums.py``). Hashing the whole snapshot before the write put a pass over
every byte ahead of it: 0.07 s of a 768 MiB persist's 0.46 s on tmpfs, where the write
itself took 0.26 s (``benchmarks/results/limits/durable/durable.md``). CRC-32C releases
the GIL, so a thread hashes the large entries while the write runs. Small entries are
hashed at once, as before: at 30,000 tensors a thread would only trade the GIL with the
write.

The thread yields to the write. It runs at the lowest priority (nice 19): on two cores, a
pipelined persist has three busy threads (the trainer's copy, the write, this one), and at
the writer's own priority this thread took half the write's core while the copy ran. On
tmpfs, 768 MiB, 15 repeats: 0.40 s at the median so, 0.36 s now, against the raw write's
0.33 s (``benchmarks/results/limits/rerun-109683f/hashing-priority``). A large entry is
hashed in chunks of ``HASH_CHUNK_BYTES``, combined afterwards (``format/crc_combine.py``):
a write that needs an entry's checksum hashes every chunk the thread has not begun itself,
so a starved thread holds it up for one chunk at most, never for a whole entry.

The slot may be released once the persist answers, so the thread is always joined
(``close``) before then.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

import torch

from ..errors import InternalError, OverlapCkptError
from ..format.checksum import hex32, updater
from ..format.crc_combine import combine
from ..format.known_sums import KNOWN_SUM_MIN_BYTES
from .slot_landing import SlotLanding

log = logging.getLogger("overlapckpt")

# Entries of at least this many bytes are hashed on the thread (the known-sum threshold: a
# smaller write is hashed by the stream anyway).
THREADED_MIN_BYTES = KNOWN_SUM_MIN_BYTES
# A large entry's unit of hashing: at hardware CRC-32C speed about 1 ms, the longest a write
# waits for the thread; 96 of them for 768 MiB, each combined in tens of microseconds.
HASH_CHUNK_BYTES = 8 << 20
# The thread's priority: the lowest, below the writer's (process.WRITER_NICE_INCREMENT).
HASHING_THREAD_NICE = 19
# Another nice value for the thread (an integer, -20 to 19); benchmarks/hashing_priority.py
# sets the writer's own, 10, to time what the lowest priority saves.
HASHING_THREAD_NICE_ENV = "OVERLAPCKPT_HASHING_THREAD_NICE"

_BUSY = -1  # a chunk being hashed, by the thread or by a caller of of()


class SnapshotChecksums:
    """Each entry's checksum (8 hex digits), by entry index: the small ones at once, the large ones as the thread gets to them."""

    def __init__(
        self, slot: torch.Tensor, nbytes: Sequence[int], offsets: Sequence[int], algorithm: str, landing: SlotLanding | None = None
    ) -> None:
        self._algorithm = algorithm
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
            hex32(update(self._data[off : off + n], 0)) if n < THREADED_MIN_BYTES and landing is None else None for off, n in self._spans
        ]
        # Each large entry's chunks, as (start, length) in the slot, and their checksums: None
        # while nobody has begun one, _BUSY while someone hashes it.
        self._chunks: dict[int, list[tuple[int, int]]] = {}
        self._chunk_sums: dict[int, list[int | None]] = {}
        for i, (off, n) in enumerate(self._spans):
            if n >= THREADED_MIN_BYTES:
                self._chunks[i] = [(start, min(HASH_CHUNK_BYTES, off + n - start)) for start in range(off, off + n, HASH_CHUNK_BYTES)]
                self._chunk_sums[i] = [None] * len(self._chunks[i])
        self._large = sorted(self._chunks, key=lambda i: self._spans[i][0])
        self._ready = threading.Condition()
        self._failure: BaseException | None = None
        self._stopping = False
        self._thread: threading.Thread | None = None
        if self._large:
            self._thread = threading.Thread(target=self._hash_large, name="overlapckpt-snapshot-sums", daemon=True)
            self._thread.start()

    def _hash_large(self) -> None:
        _yield_to_the_write()
        try:
            for i in self._large:
                for k in range(len(self._chunks[i])):
                    with self._ready:
                        if self._stopping:
                            return
                        if self._chunk_sums[i][k] is not None:  # a write took it already
                            continue
                        self._chunk_sums[i][k] = _BUSY
                    self._hash_chunk(i, k, by_the_thread=True)
        except BaseException as e:  # noqa: BLE001 - raised in every waiter
            with self._ready:
                self._failure = e
                self._ready.notify_all()

    def _hash_chunk(self, index: int, k: int, by_the_thread: bool = False) -> None:
        """Hash chunk ``k`` of entry ``index``, which the caller claimed (``_BUSY``); on failure it is unclaimed again."""
        try:
            checksum = self._landed_checksum(*self._chunks[index][k])
        except BaseException as e:
            with self._ready:
                self._chunk_sums[index][k] = None
                if by_the_thread:  # in the same hold: a waiter woken by the chunk's return sees the failure
                    self._failure = e
                self._ready.notify_all()  # a waiter for this chunk raises the thread's failure, or hashes it itself
            raise
        with self._ready:
            self._chunk_sums[index][k] = checksum
            self._ready.notify_all()

    def _landed_checksum(self, start: int, n: int) -> int:
        """The checksum of the slot's ``n`` bytes from ``start``, once they landed (a pipelined snapshot's)."""
        if self.landing is not None:
            self.landing.wait_for(start + n)
        return self._update(self._data[start : start + n], 0)  # the GIL is released while it hashes

    def of(self, index: int) -> str:
        """Entry ``index``'s checksum: its chunks the thread has not begun hashed here, the others waited for.

        The write may reach the entries in another order than the thread, and the thread may
        be starved of a core: no write waits for more than the chunks the thread holds.
        """
        checksum = self._sums[index]
        if checksum is not None:
            return checksum
        if index not in self._chunks:  # a small entry of a pipelined snapshot: hashed once it landed
            checksum = self._sums[index] = hex32(self._landed_checksum(*self._spans[index]))
            return checksum
        sums = self._chunk_sums[index]
        while True:
            with self._ready:
                self._raise_failure()
                mine = [k for k, value in enumerate(sums) if value is None]
                for k in mine:
                    sums[k] = _BUSY
                if not mine:
                    while any(value == _BUSY for value in sums):
                        self._raise_failure()
                        self._ready.wait()
                    if all(value is not None for value in sums):
                        break
                    continue  # a hasher failed and gave its chunk back: take it
            for n, k in enumerate(mine):
                try:
                    self._hash_chunk(index, k)
                except BaseException as e:
                    with self._ready:
                        for left in mine[n + 1 :]:  # given back: a waiter for them hashes them itself
                            sums[left] = None
                        self._ready.notify_all()
                    if isinstance(e, Exception) and not isinstance(e, OverlapCkptError):
                        raise InternalError(f"hashing the snapshot failed: {type(e).__name__}: {e}") from e
                    raise  # ours as it is: a copy abandoned or stopped (slot_landing.py)
        checksum = self._sums[index] = hex32(self._combined(index))
        return checksum

    def _raise_failure(self) -> None:
        """The thread's hashing failed (called holding ``_ready``): every later question fails the same way."""
        if isinstance(self._failure, OverlapCkptError):
            raise self._failure  # a copy abandoned or stopped (slot_landing.py): said as it is
        if self._failure is not None:
            raise InternalError(f"hashing the snapshot failed: {type(self._failure).__name__}: {self._failure}") from self._failure

    def _combined(self, index: int) -> int:
        """The whole entry's checksum from its chunks' (all hashed)."""
        chunks, sums = self._chunks[index], self._chunk_sums[index]
        total = sums[0]
        assert total is not None and total != _BUSY
        for (_, n), checksum in zip(chunks[1:], sums[1:]):
            assert checksum is not None and checksum != _BUSY
            total = combine(self._algorithm, total, checksum, n)
        return total

    def all(self) -> list[str]:
        """Every entry's checksum, in entry order (waits for the thread's)."""
        return [self.of(i) for i in range(len(self._sums))]

    def close(self) -> None:
        """Stop and join the thread: no read of the slot outlives the persist."""
        self._stopping = True
        if self._thread is not None:
            self._thread.join()


def hashing_thread_nice() -> int:
    """The nice value the hashing thread takes: ``HASHING_THREAD_NICE``, or the environment's (read in the writer)."""
    text = os.environ.get(HASHING_THREAD_NICE_ENV)
    if text is None:
        return HASHING_THREAD_NICE
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not -20 <= value <= 19:
        log.warning(
            "overlapckpt: %s=%r is not a nice value; set an integer from -20 to 19, or unset it for %d (the lowest priority)",
            HASHING_THREAD_NICE_ENV,
            text,
            HASHING_THREAD_NICE,
        )
        return HASHING_THREAD_NICE
    return value


def _yield_to_the_write() -> None:
    """Lower the calling thread's priority (Linux keeps a nice value per thread; one below the process's needs no privilege)."""
    nice = hashing_thread_nice()
    try:
        if nice > os.getpriority(os.PRIO_PROCESS, threading.get_native_id()):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (AttributeError, OSError) as e:  # no setpriority on this platform, or refused
        log.debug("overlapckpt: the snapshot's hashing thread keeps the writer's priority (%s)", e)
