"""The write stream that checksums the bytes DCP stores as they pass, one segment per span between two ``tell()`` calls.

Runs in the writer process, inside DCP's ``write_data`` (every shard) and its commit
(``.metadata``). How the segments become each blob's checksum, and travel to the
coordinator, is ``blobsums.py``'s; this module holds one stream's work: hashing (or taking
a snapshot tensor's known checksum, ``known_sums.py``), MACs with a signing key
(``blob_macs.py``), early writeback hints (``writeback.py``) and the time each took.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from .blob_macs import MacPipeline, new_nonce
from .checksum import updater
from .known_sums import KnownChecksums, extend
from .writeback import WRITEBACK_EVERY_BYTES, start_writeback

# With a signing key, writes larger than this go to storage, and to the MAC thread, in chunks
# of this size: each is MACed while still in the CPU's cache.
MAC_CHUNK_BYTES = 1 << 20


@dataclass
class FileSegments:
    """What one ChecksummingStream saw: the checksum of each span between two ``tell()`` calls."""

    nbytes: int = 0
    spans: dict[tuple[int, int], int] = field(default_factory=dict)  # (start, end) -> checksum
    macs: dict[tuple[int, int], str] = field(default_factory=dict)  # (start, end) -> MAC, with a signing key
    mac_nonce: str | None = None
    hashed_nbytes: int = 0  # of nbytes, those hashed here; the rest took the snapshot's checksum (known_sums.py)
    timings: StreamTimings = field(default_factory=lambda: StreamTimings())


@dataclass
class StreamTimings:
    """Where a written file's time went, in seconds: the split ``Checkpointer.stats`` reports (``persist_phases_s``)."""

    write_s: float = 0.0  # handing bytes to storage (into the page cache, for a local file)
    checksum_s: float = 0.0  # hashing them
    writeback_hint_s: float = 0.0  # asking the disk to start writing them (writeback.py)
    sync_s: float = 0.0  # from the fsync's request for the descriptor to the file's close: the fsync

    def as_phases(self) -> dict[str, float]:
        """Named as ``persist_phases_s`` names the parts of its ``write`` phase."""
        return {
            "write.to_storage": self.write_s,
            "write.checksums": self.checksum_s,
            "write.writeback_hints": self.writeback_hint_s,
            "write.fsync": self.sync_s,
        }

    def add(self, other: StreamTimings) -> None:
        self.write_s += other.write_s
        self.checksum_s += other.checksum_s
        self.writeback_hint_s += other.writeback_hint_s
        self.sync_s += other.sync_s


class ChecksummingStream:
    """A write stream that checksums its bytes, one segment per span between ``tell()`` calls.

    The position is counted here (the stream is opened for writing from byte 0), so
    ``tell()`` costs nothing on object stores.
    """

    def __init__(
        self, raw: Any, algorithm: str, known: KnownChecksums | None = None, mac_key: bytes | None = None, mac_algorithm: str | None = None
    ) -> None:
        self._raw = raw
        self._algorithm = algorithm
        self._update = updater(algorithm)
        # The host snapshot's tensors, already hashed by the writer: their bytes are not hashed again.
        self._known = known if known is not None and known.algorithm == algorithm else None
        self._position = 0
        self._span_start = 0
        self._running = 0
        self.segments = FileSegments()
        # With a signing key, each span's MAC too, of the same bytes, on a thread beside the writes
        # (blob_macs.MacPipeline); never from a known checksum: a MAC cannot be combined.
        self._macs: MacPipeline | None = None
        if mac_key is not None:
            assert mac_algorithm is not None
            self.segments.mac_nonce = new_nonce()
            self._macs = MacPipeline(mac_key, mac_algorithm, self.segments.mac_nonce)
        # A local file: ask the disk to start writing each range early (writeback.py).
        self._fd: int | None = None
        if start_writeback is not None:
            try:
                self._fd = int(raw.fileno())
            except (AttributeError, OSError, ValueError):  # an object store's stream, a test's fake
                self._fd = None
        self._written_back_to = 0
        # The first OSError storage raised (ENOSPC, EIO): torch.save's zip writer calls write()
        # from C++, which loses the exception and later fails on its own ("unexpected pos 704
        # vs 598"); create_stream raises this one instead.
        self.storage_error: OSError | None = None
        self._sync_started: float | None = None
        # torch's save settings when this file's first tensor was serialized (tensor_blob.py).
        self.serialization_settings: tuple[Any, ...] | None = None

    def _remember(self, error: OSError) -> None:
        if self.storage_error is None:
            self.storage_error = error

    def write(self, data: Any) -> int:
        view = memoryview(data)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        timings = self.segments.timings
        started = time.perf_counter()
        maced = self._macs is not None and view.nbytes > MAC_CHUNK_BYTES
        try:
            written = self._write_and_mac(view) if maced else self._write_raw(view)
        except OSError as e:
            self._remember(e)
            raise
        wrote = time.perf_counter()
        # The bytes handed to storage, read in place: no copy of the tensor; a snapshot tensor's
        # checksum, already computed, is combined instead of hashing its bytes a second time.
        stored = view if written == view.nbytes else view[:written]
        self._running, was_hashed = extend(self._update, self._algorithm, self._running, stored, self._known)
        if was_hashed:
            self.segments.hashed_nbytes += written
        if self._macs is not None and not maced:
            # A known checksum's bytes are a host-snapshot tensor, unchanged until the save ends.
            self._macs.update(self._span_start, stored, stable=not was_hashed)
        self._position += written
        hashed = time.perf_counter()
        timings.write_s += wrote - started
        timings.checksum_s += hashed - wrote
        self._hint_writeback(hashed)
        return written

    @property
    def writes_blobs_together(self) -> bool:
        """Whether ``write_blobs`` may be used: not with a signing key (each span's MAC is taken as it is written)."""
        return self._macs is None

    def write_blobs(self, blobs: list[bytes]) -> list[tuple[int, int]]:
        """Several items' bytes in one write to storage, each its own checksummed span; each one's (offset, length).

        The same spans and checksums as a ``tell()``, a ``write`` and a ``tell()`` per blob,
        without a write per blob into storage: 40,000 small blobs of 1.6 KB took 0.5 s
        through the file's 8 KiB buffer, as many system calls, on the 2-core VM.
        """
        assert self._macs is None, "write_blobs without a signing key only (writes_blobs_together)"
        self._close_span()
        timings = self.segments.timings
        started = time.perf_counter()
        spans = []
        position = self._position
        for blob in blobs:  # never a snapshot tensor's memory: no known checksum to combine
            if blob:  # as tell() around an empty write: no span
                self.segments.spans[(position, position + len(blob))] = self._update(blob, 0)
            spans.append((position, len(blob)))
            position += len(blob)
        hashed = time.perf_counter()
        joined = memoryview(b"".join(blobs))
        try:
            done = 0
            while done < joined.nbytes:  # a raw stream may take part of a write
                taken = self._write_raw(joined[done:])
                if taken <= 0:
                    raise OSError(f"the storage stream took none of a {joined.nbytes - done}-byte write")
                done += taken
        except OSError as e:
            self._remember(e)
            raise
        self.segments.hashed_nbytes += joined.nbytes
        self._position = self._span_start = position
        self.segments.nbytes = position
        wrote = time.perf_counter()
        timings.checksum_s += hashed - started
        timings.write_s += wrote - hashed
        self._hint_writeback(wrote)
        return spans

    def _hint_writeback(self, now: float) -> None:
        """A local file: ask the disk to start writing what was handed to it since the last hint, every few MiB."""
        if self._fd is not None and self._position - self._written_back_to >= WRITEBACK_EVERY_BYTES:
            self.flush()  # the bytes must be in the page cache for their writeback to start
            assert start_writeback is not None
            start_writeback(self._fd, self._written_back_to, self._position - self._written_back_to)
            self._written_back_to = self._position
            self.segments.timings.writeback_hint_s += time.perf_counter() - now

    def _write_raw(self, view: memoryview) -> int:
        written = self._raw.write(view)
        return view.nbytes if written is None else int(written)  # None: a stream that wrote it all or raised

    def _write_and_mac(self, view: memoryview) -> int:
        """A large write in chunks, each handed to the MAC thread as soon as storage has it.

        The chunk is then still in the CPU's cache: the MAC reads the tensor from there, not from
        memory a second time, beside the next chunk's copy into storage.
        """
        assert self._macs is not None
        # A host-snapshot tensor stays unchanged until the save ends: its chunks are MACed in place.
        stable = self._known is not None and self._known.holds(view)  # asked without waiting for its checksum
        total = 0
        for start in range(0, view.nbytes, MAC_CHUNK_BYTES):
            part = view[start : start + MAC_CHUNK_BYTES]
            written = self._write_raw(part)
            self._macs.update(self._span_start, part if written == part.nbytes else part[:written], stable)
            total += written
            if written < part.nbytes:
                break
        return total

    def _close_span(self) -> None:
        if self._position != self._span_start:
            self.segments.spans[(self._span_start, self._position)] = self._running
            if self._macs is not None:
                self._macs.close_span(self._span_start, self._position)
            self._span_start = self._position
            self._running = 0
        self.segments.nbytes = self._position

    def tell(self) -> int:
        self._close_span()
        return self._position

    def flush(self) -> None:
        try:
            self._raw.flush()
        except OSError as e:
            self._remember(e)
            raise

    def fileno(self) -> int:
        # DCP asks for the descriptor to fsync it: what follows, to the close, is the fsync.
        self._sync_started = time.perf_counter()
        return int(self._raw.fileno())

    def writable(self) -> bool:
        return True

    def note_end_of_writes(self) -> None:
        """The writer is done with this stream (DCP's body ended, its fsync with it): time the fsync."""
        if self._sync_started is not None:
            self.segments.timings.sync_s += time.perf_counter() - self._sync_started
            self._sync_started = None

    def finish_macs(self) -> None:
        """Wait for the spans' MACs (with a signing key) and record them; the wait counts as checksum time."""
        if self._macs is not None:
            started = time.perf_counter()
            self.segments.macs.update(self._macs.finish())
            self.segments.timings.checksum_s += time.perf_counter() - started

    def abandon_macs(self) -> None:
        """The write failed: stop the MAC thread, dropping what it has not hashed yet."""
        if self._macs is not None:
            self._macs.shut_down()

    def close(self) -> None:
        # DCP may close the stream before the file system's context ends: the MACs go on, and
        # finish_macs, called at that end, waits for them.
        self._close_span()
        self._raw.close()

    @property
    def closed(self) -> bool:
        return bool(self._raw.closed)

    def __enter__(self) -> ChecksummingStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
