"""How ``load`` reads a local checkpoint: every blob checked in the page cache first, then the tensors read into the live ones.

A load used to read every tensor into a fresh buffer of its own: a page fault per
4 KiB of state, and a load time that changed from one load to the next (issue 29).
These tests pin the two passes: the check (nothing changes before every byte the
load needs was checked) and the placement (a large tensor's data lands in the live
tensor's memory with one read, checked there too where no check preceded it). They
apply from ``TWO_PASS_MIN_BYTES`` of state; the tiny model here takes them with it set
to 0, and once with it as it is: one pass into buffers of the load's own.
"""

from __future__ import annotations

import ctypes
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from overlapckpt import Checkpointer, CorruptCheckpointError, load
from overlapckpt.format import blob_checks, blob_reader
from overlapckpt.format.blob_reader import CHECK, PLACE
from overlapckpt.format.storage import CheckpointStore
from overlapckpt.format.verify import read_manifest
from overlapckpt.restore import pipeline
from overlapckpt.restore.apply import live_state_dicts, named_as
from overlapckpt.restore.read import ReadOptions, read_into

from helpers import assert_state_equal, make_run, snapshot, train_step

SHARD = "__0_0.distcp"
STEP = "step-000000002"


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> tuple[Path, Any]:
    root = tmp_path_factory.mktemp("load-paths") / "ckpts"
    model, opt, sched, sampler = make_run()
    with Checkpointer(model, opt, root) as ckpt:
        for step in range(1, 3):
            train_step(model, opt, sched, sampler)
            if step == 2:
                ckpt.request()
                ref = snapshot(model, opt)
            ckpt.step()
        ckpt.wait(timeout_s=120)
    return root, ref


@pytest.fixture
def root(written, tmp_path) -> Path:
    import shutil

    copy = tmp_path / "ckpts"
    shutil.copytree(written[0], copy)
    return copy


@pytest.fixture(autouse=True)
def two_passes(request, monkeypatch) -> None:
    """The tiny model's state, read in two passes as a state of at least TWO_PASS_MIN_BYTES is."""
    if "one_pass" not in request.keywords:
        monkeypatch.setattr(pipeline, "TWO_PASS_MIN_BYTES", 0)


@pytest.fixture
def direct(monkeypatch) -> None:
    """Every tensor blob takes the direct path (the tiny model's tensors are far under 1 MiB)."""
    monkeypatch.setattr(blob_checks, "DIRECT_MIN_BYTES", 0)


def _fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model, opt, _, _ = make_run(seed=7)
    return model, opt


class _RecordingStream:
    """A shard's stream that records where each ``readinto`` put its bytes (address, length)."""

    def __init__(self, raw: Any, landed: list[tuple[int, int]]) -> None:
        self._raw, self._landed = raw, landed

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        address = ctypes.addressof(ctypes.c_char.from_buffer(view)) if len(view) else 0
        n = self._raw.readinto(buffer)
        self._landed.append((address, n))
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


class RecordingStore(CheckpointStore):
    landed: list[tuple[int, int]]

    def make_reader(self, name: str) -> Any:
        reader = super().make_reader(name)
        fs, landed = reader.fs, self.landed

        class RecordingFs:
            @contextmanager
            def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
                with fs.create_stream(path, mode) as raw:
                    yield _RecordingStream(raw, landed) if str(path).endswith(".distcp") else raw

            def __getattr__(self, attr: str) -> Any:
                return getattr(fs, attr)

        reader.fs = RecordingFs()
        return reader


def test_a_local_load_reads_each_large_tensor_straight_into_the_live_tensor(root, written, monkeypatch, direct):
    store = RecordingStore(str(root))
    store.landed = []
    monkeypatch.setattr(pipeline, "checkpoint_at", lambda path, step, options: (store, STEP))
    model, opt, sched, sampler = make_run(seed=7)
    train_step(model, opt, sched, sampler)  # the moments exist before the load, as in a job that trained
    live = {name: (p.data_ptr(), p.numel() * p.element_size()) for name, p in model.named_parameters()}
    moments = {id(t): t._version for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor) and t.dim()}
    load(str(root), model, opt)
    assert_state_equal(*written[1], model, opt)
    for name, (address, nbytes) in live.items():
        assert (address, nbytes) in store.landed, f"{name}'s bytes were not read into its own memory"
        assert model.get_parameter(name).data_ptr() == address  # the live tensor kept, not replaced
    # Written through memory, counted as an in-place write all the same (autograd's version counter).
    after = {id(t): t._version for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor) and t.dim()}
    assert moments and all(after[k] > v for k, v in moments.items() if k in after)


def test_a_shard_rewritten_between_the_check_and_the_read_is_refused_before_anything_changes(root, monkeypatch):
    class RewrittenAfterCheck(CheckpointStore):
        readers = 0

        def make_reader(self, name: str) -> Any:
            RewrittenAfterCheck.readers += 1
            if RewrittenAfterCheck.readers == 2:  # the placing pass: the check has run
                shard = root / STEP / SHARD
                data = shard.read_bytes()
                shard.write_bytes(data)  # the same bytes, written again: another modification time
                os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))
            return super().make_reader(name)

    store = RewrittenAfterCheck(str(root))
    monkeypatch.setattr(pipeline, "checkpoint_at", lambda path, step, options: (store, STEP))
    model, opt = _fresh()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CorruptCheckpointError, match=f"{SHARD} changed between this load's check of it and its read") as excinfo:
        load(str(root), model, opt)
    assert "partly overwritten" not in str(excinfo.value)  # refused at the file's open: nothing was read into the model
    assert RewrittenAfterCheck.readers == 2
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} changed"


def _target(root: Path, model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[CheckpointStore, Any, dict[str, Any]]:
    store = CheckpointStore(str(root))
    manifest = read_manifest(store, STEP)
    msd, osd = live_state_dicts(model, [opt])
    return store, manifest, named_as(manifest.key_layout, msd, osd)


def _data_span(root: Path, key: str) -> tuple[int, int]:
    """Where the raw bytes of ``key``'s tensor lie in the shard."""
    from overlapckpt.format.tensor_decode import locate

    manifest = read_manifest(CheckpointStore(str(root)), STEP)
    assert manifest.checksums is not None
    (blob,) = [b for b in manifest.checksums.files[SHARD].blobs if b.key == key]
    data = (root / STEP / SHARD).read_bytes()[blob.offset : blob.offset + blob.length]
    record = locate(memoryview(data))
    assert record is not None
    return blob.offset + record.data_start, blob.offset + record.data_end


@pytest.mark.parametrize("where", ["data", "framing before", "framing after"])
def test_placing_without_a_check_before_it_checks_what_it_read(root, direct, where):
    key = "model.inp.weight"
    start, end = _data_span(root, key)
    at = {"data": (start + end) // 2, "framing before": start - 5, "framing after": end + 3}[where]
    shard = root / STEP / SHARD
    data = bytearray(shard.read_bytes())
    data[at] ^= 0x10
    shard.write_bytes(bytes(data))
    model, opt = _fresh()
    store, manifest, target = _target(root, model, opt)
    with pytest.raises(CorruptCheckpointError, match=f"checksum mismatch for {key!r}"):
        read_into(store, STEP, target, options=ReadOptions(manifest=manifest, mode=PLACE))


def test_the_check_pass_hashes_on_every_core_and_the_placing_pass_reads_on_half(root, monkeypatch):
    # The check pass hashes local files through a map of the page cache, bound by the cores
    # alone; on one thread it was the whole gap to stock dcp.load (benchmarks/load.py: 1.02-1.09x
    # stock at the median on two cores, 0.89-0.94x with both). The placing pass reads into
    # memory, bound by its faults, on one thread per two cores.
    import threading

    monkeypatch.setattr(blob_reader, "usable_cores", lambda: 2)
    monkeypatch.setattr(blob_reader, "READ_BATCH_BYTES", 1)  # a batch per blob: many batches
    hashed_on: set[str] = set()
    both_hashing = threading.Barrier(2, timeout=60)  # broken (and the test failed) if one thread hashes alone
    checked_bytes = blob_checks.checked_bytes

    def recording(*args: Any, **kwargs: Any) -> Any:
        name = threading.current_thread().name
        if name not in hashed_on:
            hashed_on.add(name)
            both_hashing.wait()
        return checked_bytes(*args, **kwargs)

    monkeypatch.setattr(blob_reader, "checked_bytes", recording)  # the reader's own calls
    monkeypatch.setattr(blob_checks, "checked_bytes", recording)  # and checked_tensor's
    model, opt = _fresh()
    store, manifest, target = _target(root, model, opt)
    read_into(store, STEP, target, options=ReadOptions(manifest=manifest, mode=CHECK))
    assert len(hashed_on) == 2 and all(n.startswith("overlapckpt-read") for n in hashed_on), hashed_on
    monkeypatch.setattr(blob_reader, "checked_bytes", checked_bytes)
    monkeypatch.setattr(blob_checks, "checked_bytes", checked_bytes)
    placed_on: set[str] = set()
    place_direct = blob_reader.place_direct

    def recording_place(*args: Any, **kwargs: Any) -> Any:
        placed_on.add(threading.current_thread().name)
        return place_direct(*args, **kwargs)

    monkeypatch.setattr(blob_reader, "place_direct", recording_place)
    read_into(store, STEP, target, options=ReadOptions(manifest=manifest, mode=PLACE))
    assert placed_on == {threading.current_thread().name}  # read_thread_count(): 2 cores // 2


def test_the_check_pass_refuses_a_flipped_bit_and_places_nothing(root, direct):
    key = "model.inp.weight"
    start, end = _data_span(root, key)
    shard = root / STEP / SHARD
    data = bytearray(shard.read_bytes())
    data[start] ^= 0x01
    shard.write_bytes(bytes(data))
    model, opt = _fresh()
    before = model.inp.weight.detach().clone()
    store, manifest, target = _target(root, model, opt)
    with pytest.raises(CorruptCheckpointError, match=f"checksum mismatch for {key!r}"):
        read_into(store, STEP, target, options=ReadOptions(manifest=manifest, mode=CHECK))
    assert torch.equal(model.inp.weight, before)


def test_a_load_without_verification_that_fails_halfway_says_the_objects_are_partly_loaded(root, direct):
    manifest = read_manifest(CheckpointStore(str(root)), STEP)
    assert manifest.checksums is not None
    last = max(manifest.checksums.files[SHARD].blobs, key=lambda b: b.offset)
    shard = root / STEP / SHARD
    with open(shard, "r+b") as f:
        f.truncate(last.offset + 1)  # the last blob cut: the ones before it are read first
    model, opt = _fresh()
    with pytest.raises(CorruptCheckpointError) as excinfo:
        load(str(root), model, opt, verify=False)
    message = str(excinfo.value)
    assert f"bytes {last.offset}..{last.offset + last.length} of {SHARD}" in message
    assert "of the objects being loaded were being read into, or had been, before this: they are partly overwritten" in message


def test_a_stateful_object_the_checkpoint_lacks_is_refused_before_any_tensor_is_read(root):
    # The reads write into the live tensors: every check that can refuse runs before them.
    from overlapckpt import CheckpointMismatchError

    from helpers import StatefulSampler

    model, opt = _fresh()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointMismatchError, match=r"stateful objects \['sampler'\] are not in .*; pass the same stateful names"):
        load(str(root), model, opt, stateful={"sampler": StatefulSampler()})
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} changed"


def test_a_retired_directory_a_dead_writer_left_is_swept_by_the_next_commit(tmp_path):
    # Retention renames a retired checkpoint out of the listing, then deletes it after answering;
    # a writer killed in between leaves it. The next attempt under the lease removes it.
    root = tmp_path / "ckpts"
    leftover = root / ".retired-step-000000001-0badc0de-0123abcd"
    (leftover / "sub").mkdir(parents=True)
    (leftover / "__0_0.distcp").write_bytes(b"x" * 1024)
    other = root / ".retired-notacheckpoint"
    other.mkdir()
    model, opt, sched, sampler = make_run()
    with Checkpointer(model, opt, root) as ckpt:
        train_step(model, opt, sched, sampler)
        ckpt.step()
        ckpt.request()
        ckpt.wait(timeout_s=120)
    assert not leftover.exists()
    assert other.exists()  # not a name retention makes: left alone


@pytest.mark.one_pass
def test_a_small_state_is_read_once_into_buffers_of_the_loads_own(root, written, monkeypatch):
    """Below TWO_PASS_MIN_BYTES one reader, one DCP pass: its fresh memory is little, and a second pass would plan and walk
    every blob again (30,000 small tensors: seconds). Before: a check pass and a placing pass for every local load."""
    assert pipeline.TWO_PASS_MIN_BYTES == 64 << 20

    class CountingReaders(CheckpointStore):
        modes: list[str] = []

        def make_reader(self, name: str) -> Any:
            reader = super().make_reader(name)
            expect = reader.expect

            def recording(*args: Any, **kwargs: Any) -> None:
                CountingReaders.modes.append(kwargs.get("mode", args[2] if len(args) > 2 else None))
                expect(*args, **kwargs)

            reader.expect = recording
            return reader

    store = CountingReaders(str(root))
    monkeypatch.setattr(pipeline, "checkpoint_at", lambda path, step, options: (store, STEP))
    model, opt = _fresh()
    load(str(root), model, opt)
    assert CountingReaders.modes == [blob_reader.ADOPT]
    assert_state_equal(*written[1], model, opt)
