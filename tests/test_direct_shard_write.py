"""The writer's own ``write_data`` (format/direct_shard_write.py) against DCP's: the same files, byte for byte.

The same state is saved twice through ``CheckpointStore.make_writer``, in this process,
with torch.save's templates installed as the writer process installs them: once by the
direct write, once by DCP's own ``write_data`` (the direct write turned off). The shard
files, the blobs' offsets and lengths, and the checksums handed to the commit must be
equal. The state mixes every road: templated small tensors, a tensor over the template
limit, views that DCP clones, other dtypes, non-tensor items, two writer threads.
"""

from __future__ import annotations

import io
import os
import pickle
import weakref

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import filesystem

from overlapckpt.format import direct_shard_write, tensor_blob
from overlapckpt.format.blobsums import StoredChecksums
from overlapckpt.format.checksumming_stream import ChecksummingStream
from overlapckpt.format.shards import CoveringSavePlanner, forget_cached_plans
from overlapckpt.format.storage import CheckpointStore
from overlapckpt.format.tensor_blob import SMALL_TENSOR_MAX_BYTES, TensorBlobTemplates


@pytest.fixture
def writer_process_settings(monkeypatch):
    """What writer/process.py sets up: zip CRCs off and the templates installed (both undone after the test)."""
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    monkeypatch.setattr(filesystem, "torch", torch)
    monkeypatch.setattr(tensor_blob, "_templates", TensorBlobTemplates())
    assert tensor_blob.install()
    yield
    torch.serialization.set_crc32_options(before)


def _state() -> dict[str, object]:
    g = torch.Generator().manual_seed(11)
    state: dict[str, object] = {f"small.{i}": torch.randn(4, 4, generator=g) for i in range(40)}
    wide = torch.randn(5, 3, generator=g)
    state.update(
        {
            "bf16": torch.randn(7, generator=g).to(torch.bfloat16),
            "int_scalar": torch.tensor(12345678901, dtype=torch.int64),
            "transposed": wide.T,  # not contiguous
            "slice": torch.randn(64, generator=g)[8:24],  # a view of a larger storage: DCP clones it
            "large": torch.randn(SMALL_TENSOR_MAX_BYTES // 4 + 100, generator=g),  # over the template limit: torch.save
            "step": 7,  # non-tensor items: BYTE_IO
            "note": {"text": "kept", "values": [1, 2, 3]},
        }
    )
    return state


def _save(root, name: str, state: dict[str, object], threads: int) -> tuple[dict[str, bytes], object, StoredChecksums]:
    committed: list[StoredChecksums] = []
    forget_cached_plans()  # each save plans afresh: DCP's cached plan may order the items otherwise
    store = CheckpointStore(str(root))
    writer = store.make_writer(name, before_commit=committed.append, thread_count=threads)
    shapes = {k: tuple(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)}
    dcp.save(state, storage_writer=writer, planner=CoveringSavePlanner(shapes), no_dist=True)
    directory = os.path.join(str(root), name)
    files = {}
    for entry in sorted(os.listdir(directory)):
        if entry.endswith(".distcp"):
            with open(os.path.join(directory, entry), "rb") as f:
                files[entry] = f.read()
    with open(os.path.join(directory, ".metadata"), "rb") as f:
        metadata = pickle.load(f)
    return files, metadata, committed[0]


def _load_and_compare(root, name: str, state: dict[str, object]) -> None:
    loaded = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in state.items() if k != "note"}
    dcp.load(loaded, checkpoint_id=os.path.join(str(root), name))
    assert loaded.pop("step") == 7
    assert all(torch.equal(loaded[k], state[k]) for k in loaded)


def _counting_direct_writes(monkeypatch) -> list[int]:
    ran: list[int] = []
    direct = direct_shard_write.write_data

    def counted(writer, plan, planner):
        ran.append(len(plan.items))
        return direct(writer, plan, planner)

    monkeypatch.setattr(direct_shard_write, "write_data", counted)
    return ran


@pytest.mark.filterwarnings("ignore:.*assuming the intent is to save in a single process")
def test_the_direct_write_stores_what_dcps_write_data_stores(tmp_path, writer_process_settings, monkeypatch):
    state = _state()
    ran = _counting_direct_writes(monkeypatch)
    files, metadata, checksums = _save(tmp_path, "direct", state, 1)
    assert ran == [len(metadata.storage_data)]  # every item went through the direct write
    monkeypatch.setattr(direct_shard_write, "applies", lambda writer, plan: False)
    dcp_files, dcp_metadata, dcp_checksums = _save(tmp_path, "dcp", state, 1)
    assert len(ran) == 1  # not again: DCP's own write_data

    assert list(files) == list(dcp_files) == ["__0_0.distcp"]
    assert files["__0_0.distcp"] == dcp_files["__0_0.distcp"]
    assert metadata.storage_data == dcp_metadata.storage_data  # every item's file, offset and length
    assert checksums.files == dcp_checksums.files  # every blob's checksum, as the manifest records them
    _load_and_compare(tmp_path, "direct", state)


def _blob(root, name: str, storage) -> bytes:
    with open(os.path.join(str(root), name, storage.relative_path), "rb") as f:
        f.seek(storage.offset)
        return f.read(storage.length)


@pytest.mark.filterwarnings("ignore:.*assuming the intent is to save in a single process")
def test_each_writer_thread_saves_as_the_writers_main_thread_does(tmp_path, writer_process_settings, monkeypatch):
    """torch keeps the zip-CRC option per thread: DCP's own threads saved with CRCs on, so without templates."""
    state = _state()
    ran = _counting_direct_writes(monkeypatch)
    files, metadata, _ = _save(tmp_path, "direct", state, 2)
    assert len(ran) == 1 and sorted(files) == ["__0_0.distcp", "__0_1.distcp"]
    tensors = 0
    for index, storage in metadata.storage_data.items():
        value = state[index.fqn] if index.fqn in state else None
        if isinstance(value, torch.Tensor):
            copy = value.clone()  # minimal storage, as it was saved
            saved = io.BytesIO()
            torch.save(copy, saved)  # this thread's option: CRCs off, as the writer's main thread
            assert _blob(tmp_path, "direct", storage) == saved.getvalue(), index.fqn
            tensors += 1
    assert tensors == sum(isinstance(v, torch.Tensor) for v in state.values())
    _load_and_compare(tmp_path, "direct", state)


@pytest.mark.filterwarnings("ignore:.*assuming the intent is to save in a single process")
def test_equal_metadata_parts_are_pickled_once_and_stock_dcp_load_reads_them(tmp_path, writer_process_settings):
    state = _state()
    files, metadata, _ = _save(tmp_path, "shared", state, 1)
    tensors = metadata.state_dict_metadata
    assert tensors["small.0"].properties is tensors["small.39"].properties  # one object after unpickling: pickled once
    assert tensors["small.0"].size is tensors["small.39"].size
    assert tensors["small.0"].chunks[0] is tensors["small.39"].chunks[0]
    assert tensors["small.0"].chunks is not tensors["small.39"].chunks  # each tensor keeps its own list
    assert tensors["bf16"].properties.dtype == torch.bfloat16 and tensors["small.0"].properties.dtype == torch.float32
    loaded = {k: torch.zeros_like(v) for k, v in state.items() if isinstance(v, torch.Tensor)}
    dcp.load(loaded, checkpoint_id=os.path.join(str(tmp_path), "shared"))
    assert all(torch.equal(loaded[k], state[k]) for k in loaded)


class TrickleStream(io.RawIOBase):
    """A raw stream that takes at most 7 bytes a write, as a pipe or socket may."""

    def __init__(self, take: int = 7) -> None:
        self.data = bytearray()
        self.take = take

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        taken = bytes(b[: self.take])
        self.data += taken
        return len(taken)


def test_blobs_written_together_have_the_spans_and_checksums_of_one_write_each():
    blobs = [os.urandom(n) for n in (1, 64, 1641, 0, 300)]
    one_by_one = ChecksummingStream(TrickleStream(), "crc32c")
    tensor_blob.write_fully(one_by_one, b"head")
    for blob in blobs:
        one_by_one.tell()
        tensor_blob.write_fully(one_by_one, blob)
    one_by_one.tell()
    together_raw = TrickleStream()
    together = ChecksummingStream(together_raw, "crc32c")
    tensor_blob.write_fully(together, b"head")
    spans = together.write_blobs(blobs)
    together.tell()
    assert spans == [(4, 1), (5, 64), (69, 1641), (1710, 0), (1710, 300)]
    assert together.segments.spans == one_by_one.segments.spans
    assert bytes(together_raw.data) == b"head" + b"".join(blobs) and together.segments.nbytes == 2010


def test_a_stream_that_takes_no_bytes_fails_the_write_by_name():
    stream = ChecksummingStream(TrickleStream(take=0), "crc32c")
    with pytest.raises(OSError, match="the storage stream took none of a 10-byte write"):
        stream.write_blobs([b"x" * 10])
    assert isinstance(stream.storage_error, OSError)


def test_remembered_write_items_are_dcps_own_and_follow_the_tensor_object():
    from torch.distributed.checkpoint.planner_helpers import _create_write_items

    from overlapckpt.format.shards import LocalShard, WriteItemsMemo

    memo = WriteItemsMemo()
    view = torch.zeros(4, 4)
    first = memo.items("a", view)
    assert first == _create_write_items("a", view)
    assert all(x is y for x, y in zip(memo.items("a", view), first))  # the same view: DCP's items, not made again
    other = torch.zeros(4, 4, dtype=torch.bfloat16)  # another object at the same key
    assert memo.items("a", other)[0].tensor_data.properties.dtype == torch.bfloat16
    shard = memo.items("w", LocalShard(view, (8, 4), (4, 0)))
    assert shard == _create_write_items("w", LocalShard(view, (8, 4), (4, 0)))
    moved = memo.items("w", LocalShard(view, (8, 4), (0, 0)))  # the same tensor, placed elsewhere
    assert moved[0].index.offset == torch.Size([0, 0]) and shard[0].index.offset == torch.Size([4, 0])
    assert memo.items("b", b"bytes") == _create_write_items("b", b"bytes")
    dead = torch.zeros(2)
    memo.items("d", dead)
    gone = weakref.ref(dead)
    del dead
    assert gone() is None  # the memo holds no tensor alive (a released slot's views go)


@pytest.mark.filterwarnings("ignore:.*assuming the intent is to save in a single process")
def test_a_planner_with_remembered_items_plans_what_dcps_planner_plans(tmp_path):
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    state = _state()
    shapes = {k: tuple(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)}
    plans = []
    for planner in (CoveringSavePlanner(shapes), CoveringSavePlanner(shapes), DefaultSavePlanner()):
        forget_cached_plans()
        planner.set_up_planner(state, is_coordinator=True)
        plans.append(planner.create_local_plan())
        assert planner.state_dict["large"] is state["large"]  # the values resolved later are the tensors
    assert plans[0].items == plans[1].items == plans[2].items


class _HostStream:
    """What DCP's _OverlappingCpuLoader asks of a device stream, for CPU tensors only (nothing is in flight)."""

    def synchronize(self) -> None:
        pass

    def wait_stream(self, other) -> None:
        pass


class _HostDeviceModule:
    def __init__(self) -> None:
        self._stream = _HostStream()

    def current_stream(self) -> _HostStream:
        return self._stream

    def stream(self, stream):
        import contextlib

        return contextlib.nullcontext()


@pytest.mark.filterwarnings("ignore:.*assuming the intent is to save in a single process")
def test_where_an_accelerator_is_available_the_direct_write_orders_tensors_as_dcps_loader_does(tmp_path, writer_process_settings, monkeypatch):
    """On a GPU machine DCP's one-thread write goes through _OverlappingCpuLoader, which sorts each file's tensors by
    size: the direct write stored them in plan order there, another file (the review found it; the GPU machine's
    torch.cuda.is_available() is True)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(filesystem, "_get_available_device_type", lambda: "cuda")
    monkeypatch.setattr(filesystem, "_get_device_module", lambda device_type: _HostDeviceModule())
    state = _state()
    state["bigger_first"] = torch.randn(300, generator=torch.Generator().manual_seed(3))  # planned first, stored after smaller
    state = {"bigger_first": state.pop("bigger_first"), **state}
    files, metadata, checksums = _save(tmp_path, "direct", state, 1)
    monkeypatch.setattr(direct_shard_write, "applies", lambda writer, plan: False)
    dcp_files, dcp_metadata, dcp_checksums = _save(tmp_path, "dcp", state, 1)
    assert files["__0_0.distcp"] == dcp_files["__0_0.distcp"]
    assert metadata.storage_data == dcp_metadata.storage_data and checksums.files == dcp_checksums.files
    offsets = {index.fqn: storage.offset for index, storage in metadata.storage_data.items()}
    assert offsets["bigger_first"] > offsets["small.0"]  # sorted by size, as DCP's loader sorts


def test_the_write_items_memo_serves_views_of_alternating_slots():
    from overlapckpt.format.shards import WRITE_ITEMS_PER_KEY, WriteItemsMemo

    memo = WriteItemsMemo()
    slots = [torch.zeros(4, 4) for _ in range(WRITE_ITEMS_PER_KEY)]
    first = [memo.items("a", view) for view in slots]
    for _ in range(2):  # persists alternating between the slots: each view's own items, none made again
        for view, items in zip(slots, first):
            assert all(x is y for x, y in zip(memo.items("a", view), items))
    memo.items("a", torch.zeros(4, 4))  # one more than it keeps: the oldest goes
    assert not any(x is y for x, y in zip(memo.items("a", slots[0]), first[0]))
