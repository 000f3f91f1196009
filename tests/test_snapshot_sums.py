"""The snapshot's checksums: small entries at once, large ones on a thread beside the write, every one the entry's CRC."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from overlapckpt.errors import InternalError
from overlapckpt.format.checksum import CRC32C, hex32, updater
from overlapckpt.format.known_sums import KnownChecksums
from overlapckpt.writer import snapshot_sums
from overlapckpt.writer.snapshot_sums import THREADED_MIN_BYTES, SnapshotChecksums


def _slot(sizes: list[int]) -> tuple[torch.Tensor, list[int]]:
    offsets, at = [], 0
    for n in sizes:
        offsets.append(at)
        at += n
    generator = torch.Generator().manual_seed(3)
    return torch.randint(0, 256, (at,), dtype=torch.uint8, generator=generator), offsets


def test_every_entry_s_checksum_is_its_crc_and_the_stream_takes_the_large_ones_from_here():
    sizes = [64, THREADED_MIN_BYTES, 7, 3 * THREADED_MIN_BYTES + 5, 0]
    slot, offsets = _slot(sizes)
    sums = SnapshotChecksums(slot, sizes, offsets, CRC32C)
    try:
        update = updater(CRC32C)
        data = memoryview(slot.numpy())
        expected = [hex32(update(data[o : o + n], 0)) for o, n in zip(offsets, sizes)]
        assert sums.all() == expected
        known = KnownChecksums(CRC32C)
        large = slot[offsets[3] : offsets[3] + sizes[3]]
        known.add(large, lambda: int(sums.of(3), 16))
        assert known.checksum_of(memoryview(large.numpy())) == int(expected[3], 16)
    finally:
        sums.close()


def test_the_large_entries_are_hashed_off_the_persist_s_path_and_a_waiter_gets_each_as_it_is_done(monkeypatch):
    """The constructor returns with the large entries unhashed; the thread is joined by close()."""
    let_it_hash = threading.Event()
    real = updater(CRC32C)

    def held_for_large(data, value):
        if len(data) >= THREADED_MIN_BYTES:
            assert let_it_hash.wait(timeout=30)
        return real(data, value)

    monkeypatch.setattr(snapshot_sums, "updater", lambda algorithm: held_for_large)
    sizes = [10, 2 * THREADED_MIN_BYTES]
    slot, offsets = _slot(sizes)
    sums = SnapshotChecksums(slot, sizes, offsets, CRC32C)  # would hang here if it hashed the large one itself
    assert sums.of(0) == hex32(real(memoryview(slot.numpy())[:10], 0))
    known = KnownChecksums(CRC32C)
    large = slot[offsets[1] :]
    known.add(large, lambda: int(sums.of(1), 16))
    assert known.holds(memoryview(large.numpy()))  # a MAC's question: answered without waiting for the hash
    got: list[str] = []
    waiter = threading.Thread(target=lambda: got.append(sums.of(1)))
    waiter.start()
    let_it_hash.set()
    waiter.join(timeout=30)
    assert got == [hex32(real(memoryview(slot.numpy())[offsets[1] :], 0))]
    sums.close()
    assert not any(t.name == "overlapckpt-snapshot-sums" for t in threading.enumerate())


def test_a_hashing_failure_is_raised_to_whoever_waits_for_that_entry(monkeypatch):
    class BrokenHash(Exception):
        pass

    def broken_for_large(data, value):
        if len(data) >= THREADED_MIN_BYTES:
            raise BrokenHash("injected")
        return updater(CRC32C)(data, value)

    monkeypatch.setattr(snapshot_sums, "updater", lambda algorithm: broken_for_large)
    sizes = [10, THREADED_MIN_BYTES]
    slot, offsets = _slot(sizes)
    sums = SnapshotChecksums(slot, sizes, offsets, CRC32C)
    try:
        with pytest.raises(InternalError, match="hashing the snapshot failed: BrokenHash: injected"):
            sums.of(1)
    finally:
        sums.close()


def test_a_write_that_overtakes_the_thread_hashes_its_entry_itself_once(monkeypatch):
    """The write may reach the entries in another order: it never waits behind an entry it does not need yet."""
    first_released = threading.Event()
    real = updater(CRC32C)
    hashed_sizes: list[int] = []
    lock = threading.Lock()
    first, second = 2 * THREADED_MIN_BYTES, 3 * THREADED_MIN_BYTES

    def held_for_the_first(data, value):
        if len(data) == first:
            assert first_released.wait(timeout=30)
        with lock:
            hashed_sizes.append(len(data))
        return real(data, value)

    monkeypatch.setattr(snapshot_sums, "updater", lambda algorithm: held_for_the_first)
    sizes = [first, second]
    slot, offsets = _slot(sizes)
    sums = SnapshotChecksums(slot, sizes, offsets, CRC32C)  # its thread is held in the first entry
    try:
        assert sums.of(1) == hex32(real(memoryview(slot.numpy())[offsets[1] :], 0))  # returns with the first still held
        first_released.set()
        assert sums.of(0) == hex32(real(memoryview(slot.numpy())[:first], 0))
    finally:
        sums.close()
    assert sorted(hashed_sizes) == [first, second]  # each hashed once: the thread skipped the one the write took


class _Hashing:
    """An updater that holds the hashing thread in its first chunk until ``release``, counting each thread's chunks."""

    def __init__(self, monkeypatch) -> None:
        self.real = updater(CRC32C)
        self.release = threading.Event()
        self.by_thread: dict[str, int] = {}
        self.changed = threading.Condition()
        monkeypatch.setattr(snapshot_sums, "updater", lambda algorithm: self._update)

    def _update(self, data, value):
        name = threading.current_thread().name
        with self.changed:
            first_of_the_thread = name == "overlapckpt-snapshot-sums" and name not in self.by_thread
            self.by_thread[name] = self.by_thread.get(name, 0) + 1
            self.changed.notify_all()
        if first_of_the_thread:
            assert self.release.wait(timeout=30)
        return self.real(data, value)

    def wait_until(self, name: str, count: int) -> None:
        with self.changed:
            assert self.changed.wait_for(lambda: self.by_thread.get(name, 0) >= count, timeout=30), self.by_thread


def test_a_write_waits_for_one_chunk_the_thread_holds_and_hashes_the_rest_of_the_entry_itself(monkeypatch):
    """The thread runs at the lowest priority and may be starved: a write that needs a large entry waits for the chunk
    the thread is on, never for the whole entry, and the chunks' checksums combine into the entry's CRC."""
    monkeypatch.setattr(snapshot_sums, "HASH_CHUNK_BYTES", THREADED_MIN_BYTES)
    hashing = _Hashing(monkeypatch)
    sizes = [4 * THREADED_MIN_BYTES + 3]  # five chunks, the last of 3 bytes
    slot, offsets = _slot(sizes)
    sums = SnapshotChecksums(slot, sizes, offsets, CRC32C)
    got: list[str] = []
    waiter = threading.Thread(target=lambda: got.append(sums.of(0)), name="the-write")
    try:
        hashing.wait_until("overlapckpt-snapshot-sums", 1)  # the thread holds its first chunk
        waiter.start()
        hashing.wait_until("the-write", 4)  # the write hashed the other four itself...
        assert hashing.by_thread == {"overlapckpt-snapshot-sums": 1, "the-write": 4}
        assert got == []  # ...and waits for the held one
        hashing.release.set()
        waiter.join(timeout=30)
        assert got == [hex32(hashing.real(memoryview(slot.numpy()), 0))]
    finally:
        hashing.release.set()
        sums.close()


def test_the_hashing_thread_runs_at_the_lowest_priority(monkeypatch):
    """On two cores a pipelined persist has three busy threads: at the writer's own priority this one took half the
    write's core (snapshot_sums.py's docstring). Linux keeps a nice value per thread."""
    hashing = _Hashing(monkeypatch)
    sizes = [THREADED_MIN_BYTES]
    slot, offsets = _slot(sizes)
    sums = SnapshotChecksums(slot, sizes, offsets, CRC32C)
    try:
        hashing.wait_until("overlapckpt-snapshot-sums", 1)
        (thread,) = [t for t in threading.enumerate() if t.name == "overlapckpt-snapshot-sums"]
        assert os.getpriority(os.PRIO_PROCESS, thread.native_id) == snapshot_sums.HASHING_THREAD_NICE == 19
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) < 19  # the caller's own is left alone
    finally:
        hashing.release.set()
        sums.close()


def test_the_hashing_thread_s_nice_value_from_the_environment_is_checked(monkeypatch, caplog):
    monkeypatch.setenv(snapshot_sums.HASHING_THREAD_NICE_ENV, "10")
    assert snapshot_sums.hashing_thread_nice() == 10
    for bad in ("high", "20", "-21"):
        monkeypatch.setenv(snapshot_sums.HASHING_THREAD_NICE_ENV, bad)
        caplog.clear()
        with caplog.at_level("WARNING", logger="overlapckpt"):
            assert snapshot_sums.hashing_thread_nice() == 19
        assert f"OVERLAPCKPT_HASHING_THREAD_NICE={bad!r} is not a nice value; set an integer from -20 to 19" in caplog.text
    monkeypatch.delenv(snapshot_sums.HASHING_THREAD_NICE_ENV)
    assert snapshot_sums.hashing_thread_nice() == 19


def test_a_write_waiting_for_the_thread_s_chunk_gets_the_thread_s_failure_not_a_hash_of_its_own(monkeypatch):
    """The thread gives its chunk back and records its failure in one hold of the lock: the waiter it wakes raises."""

    class BrokenHash(Exception):
        pass

    monkeypatch.setattr(snapshot_sums, "HASH_CHUNK_BYTES", THREADED_MIN_BYTES)
    hashing = _Hashing(monkeypatch)
    real_update = hashing._update

    def thread_fails(data, value):
        result = real_update(data, value)  # counts, and holds the thread's first chunk until released
        if threading.current_thread().name == "overlapckpt-snapshot-sums":
            raise BrokenHash("injected")
        return result

    monkeypatch.setattr(hashing, "_update", thread_fails)
    sizes = [2 * THREADED_MIN_BYTES]
    slot, offsets = _slot(sizes)
    sums = SnapshotChecksums(slot, sizes, offsets, CRC32C)
    raised: list[BaseException] = []

    def write() -> None:
        try:
            sums.of(0)
        except BaseException as e:  # noqa: BLE001 - checked below
            raised.append(e)

    waiter = threading.Thread(target=write, name="the-write")
    try:
        hashing.wait_until("overlapckpt-snapshot-sums", 1)
        waiter.start()
        hashing.wait_until("the-write", 1)  # its own chunk; now it waits for the thread's
        hashing.release.set()
        waiter.join(timeout=30)
        assert [type(e) for e in raised] == [InternalError]
        assert "hashing the snapshot failed: BrokenHash: injected" in str(raised[0])
        assert hashing.by_thread == {"overlapckpt-snapshot-sums": 1, "the-write": 1}  # never hashed the thread's chunk
    finally:
        hashing.release.set()
        sums.close()
