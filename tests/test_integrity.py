"""Every stored byte is checked: single flipped bits, truncations and storage failures, on real checkpoints.

One run (a real Checkpointer and its writer process) commits checkpoints of steps 1
and 3; each test works on its own copy of that root and flips bits back after use.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import socket
import struct
import subprocess
import sys
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, Iterator

import pytest
import torch

from overlapckpt import (
    Checkpointer,
    CheckpointNotFoundError,
    CheckpointReadError,
    ConfigError,
    CorruptCheckpointError,
    list_checkpoints,
    load,
)
from overlapckpt.cli import main
from overlapckpt.errors import CheckpointWriteError
from overlapckpt.format import verify as verify_module
from overlapckpt.format.blobsums import attach_checksums
from overlapckpt.format.checksum import ALGORITHM_ENV, CRC32, CRC32C, default_algorithm, updater
from overlapckpt.format.checksumming_stream import ChecksummingStream, FileSegments
from overlapckpt.format.extra_state import tensor_bytes
from overlapckpt.format.known_sums import KNOWN_SUM_MIN_BYTES, KnownChecksums
from overlapckpt.format.manifest import MANIFEST_NAME, dump_manifest, parse_manifest, tensor_checksum
from overlapckpt.format.storage import CheckpointStore
from overlapckpt.format.verify import read_manifest, verify_checkpoint

from helpers import assert_state_equal, make_run, snapshot, train_step

SHARD = "__0_0.distcp"
STEP1, STEP3 = "step-000000001", "step-000000003"


def _write_run(root: Path) -> dict[int, Any]:
    """Window-1 checkpoints of steps 1 and 3; the reference states and model.inp.weight's bytes."""
    model, opt, sched, sampler = make_run()
    refs: dict[int, Any] = {}
    with Checkpointer(model, opt, root) as ckpt:
        for step in range(1, 4):
            train_step(model, opt, sched, sampler)
            if step in (1, 3):
                ckpt.request()
                refs[step] = snapshot(model, opt)
            ckpt.step()
            ckpt.wait(timeout_s=120)
    refs["weight_bytes"] = tensor_bytes(model.inp.weight.detach().contiguous())
    refs["lr"] = opt.param_groups[0]["lr"]
    return refs


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> tuple[Path, dict[int, Any]]:
    root = tmp_path_factory.mktemp("integrity") / "ckpts"
    return root, _write_run(root)


@pytest.fixture
def run(written, tmp_path) -> tuple[Path, dict[int, Any]]:
    """A private copy of the committed run."""
    root, refs = written
    copy = tmp_path / "ckpts"
    shutil.copytree(root, copy)
    return copy, refs


def _manifest(root: Path, name: str = STEP3) -> dict[str, Any]:
    return json.loads((root / name / MANIFEST_NAME).read_text())


def _blobs(root: Path, name: str = STEP3) -> list[dict[str, Any]]:
    return _manifest(root, name)["checksums"]["files"][SHARD]["blobs"]


def _blob(root: Path, key: str) -> dict[str, Any]:
    (blob,) = [b for b in _blobs(root) if b["key"] == key]
    return blob


def _key_at(root: Path, pos: int) -> str:
    (key,) = [b["key"] for b in _blobs(root) if b["offset"] <= pos < b["offset"] + b["length"]]
    return key


@contextmanager
def _flipped(path: Path, pos: int, mask: int) -> Iterator[None]:
    """One flipped bit at byte ``pos`` of ``path``, flipped back afterwards."""
    raw = bytearray(path.read_bytes())
    raw[pos] ^= mask
    path.write_bytes(bytes(raw))
    try:
        yield
    finally:
        raw[pos] ^= mask
        path.write_bytes(bytes(raw))


def _fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model, opt, _, _ = make_run(seed=7)
    return model, opt


def _assert_refused(root: Path, capsys, *needles: str, step: int = 3) -> None:
    """load(verify=True) and `overlapckpt verify` both refuse checkpoint ``step``, naming each needle."""
    model, opt = _fresh()
    before = model.inp.weight.detach().clone()
    with pytest.raises(CorruptCheckpointError) as excinfo:
        load(str(root), model, opt, step=step)
    for needle in needles:
        assert needle in str(excinfo.value)
    assert torch.equal(model.inp.weight, before)  # refused before anything changed
    capsys.readouterr()
    assert main(["verify", str(root), "--step", str(step)]) == 1
    out = capsys.readouterr().out
    assert out.startswith("CORRUPT")
    for needle in needles:
        assert needle in out


def _assert_clean(root: Path, refs: dict[int, Any], capsys) -> None:
    model, opt = _fresh()
    assert load(str(root), model, opt, step=3).step == 3
    assert_state_equal(*refs[3], model, opt)
    capsys.readouterr()
    assert main(["verify", "--all", str(root)]) == 0
    assert capsys.readouterr().out.count("checksum matches") == 2


def _shard_positions(root: Path, refs: dict[int, Any]) -> dict[str, tuple[int, int]]:
    """Positions (byte, bit mask) to flip in step 3's shard, each with what it hits."""
    shard = (root / STEP3 / SHARD).read_bytes()
    positions: dict[str, tuple[int, int]] = {}
    lr_blob = _blob(root, "optimizer.param_groups.0.lr")
    # The stored lr: pickle's BINFLOAT opcode 'G' and 8 big-endian bytes, inside its torch.save zip.
    lr_at = shard.find(b"G" + struct.pack(">d", refs["lr"]), lr_blob["offset"], lr_blob["offset"] + lr_blob["length"])
    assert lr_at >= 0  # precondition: the lr is stored where the manifest says its blob is
    positions["lr exponent"] = (lr_at + 2, 0x10)
    positions["lr mantissa"] = (lr_at + 8, 0x01)
    betas = _blob(root, "optimizer.param_groups.0.betas")
    positions["betas blob, middle"] = (betas["offset"] + betas["length"] // 2, 0x04)
    weight = _blob(root, "model.inp.weight")
    start, end = weight["offset"], weight["offset"] + weight["length"]
    data_at = shard.find(refs["weight_bytes"], start, end)
    assert data_at > start  # precondition: the tensor's bytes lie inside its blob, after framing
    positions["tensor data"] = (data_at + 5, 0x10)
    positions["zip local header signature"] = (start, 0x01)
    positions["zip local header file name"] = (start + 30, 0x20)
    positions["zip framing before tensor data"] = (data_at - 1, 0x01)
    central = shard.find(b"PK\x01\x02", start, end)
    assert central > data_at  # precondition: the central directory follows the data
    positions["zip central directory"] = (central + 10, 0x02)
    positions["zip end of central directory"] = (end - 1, 0x80)
    rng = random.Random(20261130)
    for pos in sorted(rng.sample(range(len(shard)), 14)):
        positions[f"random byte {pos}"] = (pos, 1 << rng.randrange(8))
    return positions


@pytest.fixture(params=["whole", "spans"])
def hashing(request, monkeypatch) -> str:
    """Both ways a load hashes a tensor's blob: whole, then the decoded tensor again (small blobs), or in three
    spans combined, the data span's checksum being the tensor's (large blobs; here every blob)."""
    from overlapckpt.format import blob_checks

    if request.param == "spans":
        monkeypatch.setattr(blob_checks, "SPLIT_MIN_BYTES", 0)
    return request.param


def test_single_bit_flips_anywhere_in_the_shard_are_refused(run, capsys, hashing):
    root, refs = run
    _assert_clean(root, refs, capsys)
    shard = root / STEP3 / SHARD
    positions = _shard_positions(root, refs)
    assert len(positions) >= 20
    for _what, (pos, mask) in positions.items():
        key = _key_at(root, pos)
        with _flipped(shard, pos, mask):
            _assert_refused(root, capsys, f"checksum mismatch for {key!r}", f"{STEP3}/{SHARD}")
    _assert_clean(root, refs, capsys)  # flipped back: the same checks pass


def test_a_flipped_lr_loads_silently_without_verification(run, capsys):
    # Why the stored-byte checksums matter: the per-tensor CRCs never see param_groups.
    root, refs = run
    pos, mask = _shard_positions(root, refs)["lr exponent"]
    with _flipped(root / STEP3 / SHARD, pos, mask):
        model, opt = _fresh()
        load(str(root), model, opt, step=3, verify=False)
        assert opt.param_groups[0]["lr"] != refs["lr"]  # wrong, and nothing said so
        _assert_refused(root, capsys, "'optimizer.param_groups.0.lr'")


def test_the_typed_manifest_reads_and_writes_the_same_document(run):
    root, _ = run
    raw = (root / STEP3 / MANIFEST_NAME).read_bytes()
    manifest = parse_manifest(raw, "written")
    document = json.loads(raw)
    document.pop("manifest_crc32")
    assert manifest.to_json() == document  # every field the writer wrote has a typed home
    assert manifest.checksums is not None and SHARD in manifest.checksums.files
    item = manifest.items["model.inp.weight"]
    assert item.checksum is not None and item.crc32 is None  # format 3: in the checkpoint's algorithm
    assert manifest.format_version == 4  # format 3's fields, on one line, manifest_crc32 last


def test_every_single_bit_flip_of_the_manifest_fails_its_checksum(run):
    root, _ = run
    raw = (root / STEP3 / MANIFEST_NAME).read_bytes()
    assert parse_manifest(raw, "clean").step == 3  # precondition: the clean bytes parse
    buf = bytearray(raw)
    for pos in range(len(buf)):
        for bit in range(8):
            buf[pos] ^= 1 << bit
            with pytest.raises(CorruptCheckpointError):
                parse_manifest(bytes(buf), f"byte {pos} bit {bit}")
            buf[pos] ^= 1 << bit


def test_a_format_3_manifest_indented_with_its_checksum_on_a_line_of_its_own_still_reads_and_checks(run):
    """Format 4 writes one line, the checksum last; a checkpoint written before (format 3, indented) reads as it did."""
    root, _ = run
    document = json.loads((root / STEP3 / MANIFEST_NAME).read_bytes())
    document["format_version"] = 3
    document["manifest_crc32"] = "0" * 8
    zeroed = json.dumps(document, indent=1, sort_keys=True, allow_nan=True).encode()  # how format 3 was written
    at = zeroed.index(b'\n "manifest_crc32": "') + len(b'\n "manifest_crc32": "')
    raw = zeroed[:at] + f"{zlib.crc32(zeroed) & 0xFFFFFFFF:08x}".encode() + zeroed[at + 8 :]
    assert b"\n" in raw and not raw.endswith(b'"}')
    manifest = parse_manifest(raw, "format 3")
    assert manifest.format_version == 3 and manifest.step == 3
    changed = bytearray(raw)
    changed[raw.index(b'"step": 3') + 8] ^= 0x01
    with pytest.raises(CorruptCheckpointError, match="fails its own checksum"):
        parse_manifest(bytes(changed), "format 3, changed")


def test_the_manifest_is_one_line_and_ends_with_its_checksum_so_no_nested_key_is_taken_for_it(run):
    root, _ = run
    raw = (root / STEP3 / MANIFEST_NAME).read_bytes()
    assert b"\n" not in raw and raw[-len(b'"manifest_crc32": "00000000"}') :].startswith(b'"manifest_crc32": "')
    document = json.loads(raw)
    document["stats"] = {"manifest_crc32": "ffffffff", "aaa": {"manifest_crc32": "00000000"}}  # sorts before the real one
    written = dump_manifest(document)
    assert parse_manifest(written, "nested keys").step == 3


def test_flipped_or_truncated_manifest_is_refused(run, capsys):
    root, refs = run
    path = root / STEP3 / MANIFEST_NAME
    raw = path.read_bytes()
    rng = random.Random(3)
    positions = [raw.index(b'"step": 3') + 8, raw.index(b'"manifest_crc32": "') + 20, len(raw) - 1]
    positions += rng.sample(range(len(raw)), 3)
    for pos in positions:
        with _flipped(path, pos, 1 << rng.randrange(8)):
            _assert_refused(root, capsys, f"{STEP3}/{MANIFEST_NAME}")
    for cut in (len(raw) // 2, len(raw) - 1):
        path.write_bytes(raw[:cut])
        _assert_refused(root, capsys, f"{STEP3}/{MANIFEST_NAME}")
    path.write_bytes(raw)
    _assert_clean(root, refs, capsys)


def test_flipped_or_garbled_metadata_is_refused(run, capsys):
    root, refs = run
    path = root / STEP3 / ".metadata"
    raw = path.read_bytes()
    rng = random.Random(5)
    for pos in [0, len(raw) - 1, *rng.sample(range(len(raw)), 4)]:
        with _flipped(path, pos, 1 << rng.randrange(8)):
            _assert_refused(root, capsys, f"checksum mismatch for {root / STEP3}/.metadata")
    middle = len(raw) // 2
    path.write_bytes(raw[:middle] + bytes(rng.randrange(256) for _ in range(64)) + raw[middle + 64 :])
    _assert_refused(root, capsys, f"{root / STEP3}/.metadata")
    path.write_bytes(raw[:middle])
    _assert_refused(root, capsys, f"{root / STEP3}/.metadata is {middle} bytes")
    path.write_bytes(raw)
    _assert_clean(root, refs, capsys)


def test_truncated_shard_is_refused(run, capsys):
    root, refs = run
    path = root / STEP3 / SHARD
    raw = path.read_bytes()
    for cut in (len(raw) - 1, len(raw) // 2):
        path.write_bytes(raw[:cut])
        key = _key_at(root, cut)
        _assert_refused(root, capsys, f"{SHARD} is {cut} bytes", f"{key!r} in {root / STEP3}/{SHARD}", "truncated")
    path.write_bytes(raw + b"\0")  # extended by one byte: also not what was written
    _assert_refused(root, capsys, f"{SHARD} is {len(raw) + 1} bytes")
    path.write_bytes(raw)
    _assert_clean(root, refs, capsys)


class _RecordingReader:
    """A shard opened for reading that records the size of every read."""

    def __init__(self, f: BinaryIO, sizes: list[int]) -> None:
        self._f = f
        self._sizes = sizes

    def read(self, n: int = -1) -> bytes:
        data = self._f.read(n)
        self._sizes.append(len(data))
        return data


class RecordingStore(CheckpointStore):
    """Records every read: shard reads by size, whole-file reads by name."""

    def __init__(self, root: str, storage_options: dict[str, Any] | None = None) -> None:
        super().__init__(root, storage_options)
        self.shard_reads: dict[str, list[int]] = {}
        self.whole_files: list[str] = []

    @contextmanager
    def open_read(self, name: str, filename: str) -> Iterator[BinaryIO]:
        with super().open_read(name, filename) as f:
            yield _RecordingReader(f, self.shard_reads.setdefault(filename, []))  # type: ignore[misc]

    def read_bytes(self, name: str, filename: str) -> bytes:
        self.whole_files.append(filename)
        return super().read_bytes(name, filename)


@pytest.mark.parametrize("chunk_bytes", [verify_module.VERIFY_CHUNK_BYTES, 700])
def test_verify_streams_blob_by_blob(written, monkeypatch, chunk_bytes):
    root, _ = written
    monkeypatch.setattr(verify_module, "VERIFY_CHUNK_BYTES", chunk_bytes)
    store = RecordingStore(str(root))
    report = verify_checkpoint(store, STEP3)
    assert report.ok, report.problems
    blobs = _blobs(root)
    sizes = store.shard_reads[SHARD]
    assert sum(sizes) == (root / STEP3 / SHARD).stat().st_size  # every byte read once
    assert max(sizes) <= min(chunk_bytes, max(b["length"] for b in blobs))
    # No read crosses a blob boundary: every blob's end is the end of some read.
    ends, position = set(), 0
    for size in sizes:
        position += size
        ends.add(position)
    assert {b["offset"] + b["length"] for b in blobs} <= ends
    assert len(sizes) >= len(blobs) and report.blobs == len(blobs)
    assert sorted(store.whole_files) == [".metadata", MANIFEST_NAME]  # only the small files are read whole


def test_load_and_list_agree_on_a_damaged_manifest(run, capsys):
    root, refs = run
    path = root / STEP3 / MANIFEST_NAME
    assert (root / "latest").read_text() == STEP3  # precondition: `latest` names the one to damage
    with _flipped(path, path.read_bytes().index(b'"window": 1') + 10, 0x02):
        with pytest.warns(UserWarning, match=f"skipping .*{STEP3}"):
            listed = [i.step for i in list_checkpoints(str(root))]
        assert listed == [1]
        model, opt = _fresh()
        with pytest.warns(UserWarning, match=f"skipping .*{STEP3}"):
            info = load(str(root), model, opt)
        assert info.step == listed[-1] == 1
        assert_state_equal(*refs[1], model, opt)
        with pytest.raises(CorruptCheckpointError, match="fails its own checksum"):
            load(str(root), *_fresh(), step=3)
        assert main(["verify", str(root)]) == 1  # verify checks the newest committed one, damaged or not
    assert [i.step for i in list_checkpoints(str(root))] == [1, 3]
    model, opt = _fresh()
    assert load(str(root), model, opt).step == 3


class FlakyStore(CheckpointStore):
    """Storage that fails on purpose: reads of ``fail_on`` raise ``error`` (a shard mid-stream)."""

    def __init__(self, root: str, fail_on: str, error: BaseException) -> None:
        super().__init__(root)
        self.fail_on = fail_on
        self.error = error

    def read_bytes(self, name: str, filename: str) -> bytes:
        if filename == self.fail_on:
            raise self.error
        return super().read_bytes(name, filename)

    @contextmanager
    def open_read(self, name: str, filename: str) -> Iterator[BinaryIO]:
        with super().open_read(name, filename) as f:
            if filename == self.fail_on:
                f.read(100)
                raise self.error
            yield f


@pytest.mark.parametrize(
    "fail_on, error",
    [
        (MANIFEST_NAME, ConnectionResetError(errno.ECONNRESET, "Connection reset by peer")),
        (".metadata", OSError(errno.EIO, "Input/output error")),
        (SHARD, ConnectionError("connection lost mid-read")),
    ],
)
def test_storage_failures_are_read_errors_not_corruption(written, fail_on, error):
    root, _ = written
    store = FlakyStore(str(root), fail_on, error)
    assert verify_checkpoint(CheckpointStore(str(root)), STEP3).ok  # precondition: the bytes are fine
    with pytest.raises(CheckpointReadError) as excinfo:
        verify_checkpoint(store, STEP3)
    assert not isinstance(excinfo.value, CorruptCheckpointError)
    assert isinstance(excinfo.value, OSError) and excinfo.value.__cause__ is error
    assert "this is not corruption" in str(excinfo.value)


def test_a_missing_shard_is_a_read_error_in_load_and_verify(run, capsys):
    root, _ = run
    (root / STEP3 / SHARD).unlink()
    for verify in (True, False):  # caught by verify's streaming, or by DCP's own read
        with pytest.raises(CheckpointReadError) as excinfo:
            load(str(root), *_fresh(), step=3, verify=verify)
        assert isinstance(excinfo.value.__cause__, FileNotFoundError)
    capsys.readouterr()
    assert main(["verify", str(root), "--step", "3"]) == 2  # could not run, not corrupt
    assert "FileNotFoundError" in capsys.readouterr().err


def test_unreachable_s3_is_a_read_error():
    pytest.importorskip("s3fs")
    options = {
        "endpoint_url": "http://127.0.0.1:9", "key": "a", "secret": "b",
        "client_kwargs": {"region_name": "us-east-1"}, "config_kwargs": {"retries": {"max_attempts": 1}},
    }
    with pytest.raises(CheckpointReadError, match="EndpointConnectionError"):
        load("s3://ckpts/unreachable", *_fresh(), storage_options=options)
    with pytest.raises(CheckpointReadError):
        list_checkpoints("s3://ckpts/unreachable", storage_options=options)


def test_crc32_fallback_checkpoints_verify_and_refuse_flips(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(ALGORITHM_ENV, CRC32)  # the writer process inherits it
    root = tmp_path / "ckpts"
    model, opt, sched, sampler = make_run()
    with Checkpointer(model, opt, root) as ckpt:
        train_step(model, opt, sched, sampler)
        ckpt.request()
        ref = snapshot(model, opt)
        ckpt.step()
        ckpt.wait(timeout_s=120)
    assert _manifest(root, STEP1)["checksums"]["algorithm"] == CRC32
    shard = root / STEP1 / SHARD
    blob = _blobs(root, STEP1)[3]
    with _flipped(shard, blob["offset"] + 7, 0x08):
        _assert_refused(root, capsys, f"checksum mismatch for {blob['key']!r}", step=1)
    fresh_model, fresh_opt = _fresh()
    load(str(root), fresh_model, fresh_opt)
    assert_state_equal(*ref, fresh_model, fresh_opt)


def test_crc32c_checkpoint_without_the_package_names_the_fix(written, monkeypatch, capsys):
    root, _ = written
    if _manifest(root)["checksums"]["algorithm"] != CRC32C:
        pytest.skip("the crc32c package is not installed here, so checkpoints use crc32")
    monkeypatch.setitem(sys.modules, "crc32c", None)  # what `import crc32c` meets where it is not installed
    with pytest.raises(ConfigError, match=r"pip install crc32c \(a dependency of overlapckpt\)"):
        load(str(root), *_fresh())
    assert main(["verify", str(root)]) == 2  # could not run: not corrupt
    assert "needs the crc32c package" in capsys.readouterr().err
    assert [i.step for i in list_checkpoints(str(root))] == [1, 3]  # manifests use CRC-32: still readable


def test_bytes_outside_every_item_are_refused_at_write(tmp_path):
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.storage import WriteResult

    def result(offset: int, length: int) -> WriteResult:
        return WriteResult(index=MetadataIndex("a"), size_in_bytes=length, storage_data=_StorageInfo("f", offset, length))

    with open(tmp_path / "f", "wb") as raw:
        stream = ChecksummingStream(raw, CRC32)
        stream.tell()
        stream.write(b"abc")
        stream.tell()
        stream.write(b"trailing bytes no item owns")
        stream.close()
    assert stream.segments.nbytes == 3 + 27
    with pytest.raises(CheckpointWriteError, match=r"bytes 3..30 of f belong to no item"):
        attach_checksums([result(0, 3)], {"f": stream.segments}, CRC32)
    with pytest.raises(CheckpointWriteError, match="was not written between two tell"):
        attach_checksums([result(0, 2)], {"f": FileSegments(3, {(0, 3): 1})}, CRC32)


def test_a_snapshot_tensor_is_hashed_once_on_its_way_to_storage(tmp_path):
    # The writer hashed the snapshot's tensors already (the manifest's per-item checksums):
    # the stream combines that checksum into the blob's instead of hashing the tensor's bytes
    # again. Failed before: every stored byte was hashed a second time.
    algorithm = default_algorithm()
    tensor = torch.arange(2 * KNOWN_SUM_MIN_BYTES // 4, dtype=torch.float32)
    known = KnownChecksums(algorithm)
    known.add(tensor, int(tensor_checksum(tensor, algorithm), 16))
    hashed = {}
    for name, stored in (("known", tensor), ("a copy elsewhere", tensor.clone())):
        with open(tmp_path / name, "wb") as raw:
            stream = ChecksummingStream(raw, algorithm, known)
            stream.tell()
            torch.save(stored, stream)
            stream.tell()
        blob = (tmp_path / name).read_bytes()
        assert stream.segments.spans == {(0, len(blob)): updater(algorithm)(blob, 0)}  # the blob's true checksum
        hashed[name] = stream.segments.hashed_nbytes
    assert hashed["known"] == len(blob) - tensor.nbytes  # torch.save's framing only
    assert hashed["a copy elsewhere"] == len(blob)  # other memory: hashed whole


def _big_run() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(3)
    model = torch.nn.Linear(1024, 512)  # a 2 MiB weight and 2 MiB moments: over KNOWN_SUM_MIN_BYTES
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 1024)).sum().backward()
    opt.step()
    return model, opt


def test_stored_checksums_taken_from_the_snapshot_verify_every_byte(tmp_path):
    model, opt = _big_run()
    with Checkpointer(model, opt, str(tmp_path)) as ckpt:
        ckpt.request()
        ckpt.step()
        ckpt.wait(timeout_s=120)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    (name,) = [p.name for p in tmp_path.iterdir() if p.name.startswith("step-")]
    report = verify_checkpoint(CheckpointStore(str(tmp_path)), name)  # every stored byte hashed against the manifest
    assert report.ok, report
    fresh, fresh_opt = _big_run()
    torch.nn.init.zeros_(fresh.weight)
    load(str(tmp_path), fresh, fresh_opt)
    assert all(torch.equal(v, expected[k]) for k, v in fresh.state_dict().items())


def test_a_slot_changed_after_its_checksum_is_refused_at_load(tmp_path):
    # What the stored checksums trust (known_sums.py): the slot is not written between its
    # snapshot checksum and its store. Broken on purpose here, the load must see it.
    from fakes import WritesTheSlotAfterItsChecksumStore

    model, opt = _big_run()
    with Checkpointer(model, opt, str(tmp_path), store_class=WritesTheSlotAfterItsChecksumStore) as ckpt:
        ckpt.request()
        ckpt.step()
        ckpt.wait(timeout_s=120)
    fresh, fresh_opt = _big_run()
    before = fresh.weight.detach().clone()
    with pytest.raises(CorruptCheckpointError, match=r"checksum mismatch for 'model\.weight'"):
        load(str(tmp_path), fresh, fresh_opt)
    assert torch.equal(fresh.weight, before)  # refused before anything changed


_TWO_RANK_SAVE = r"""
import os, sys, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
from overlapckpt.format.storage import CheckpointStore
from overlapckpt.format.manifest import dump_manifest
rank = int(os.environ["RANK"])
dist.init_process_group("gloo")
store = CheckpointStore(sys.argv[1])
# Each rank owns different tensors, as a DDP share or FSDP shards would.
state = {f"rank{rank}": {"w": torch.full((64,), float(rank + 1)), "lr": 0.01 * (rank + 1)}}
manifest = {"format_version": 2, "step": 5, "requested_step": 5, "mode": "window", "window": 1, "nbytes": 0,
            "items": {}, "created_at": 0.0, "torch_version": torch.__version__}
def write_manifest(checksums):  # runs on the coordinator only, with every rank's checksums
    manifest["checksums"] = checksums.to_json()
    store.write_manifest("step-000000005", dump_manifest(manifest))
dcp.save(state, storage_writer=store.make_writer("step-000000005", before_commit=write_manifest))
dist.destroy_process_group()
"""


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_checksums_travel_from_every_rank_to_the_coordinator(tmp_path):
    pytest.importorskip("numpy")  # torch's gather_object over gloo converts through numpy
    root = tmp_path / "ckpts"
    (root / "step-000000005").mkdir(parents=True)
    repo = str(Path(__file__).resolve().parent.parent)
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2")
    env["PYTHONPATH"] = os.pathsep.join([repo, env.get("PYTHONPATH", "")])
    procs = [
        subprocess.Popen([sys.executable, "-c", _TWO_RANK_SAVE, str(root)], env=dict(env, RANK=str(r)))
        for r in range(2)
    ]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    files = _manifest(root, "step-000000005")["checksums"]["files"]
    assert sorted(files) == ["__0_0.distcp", "__1_0.distcp"]  # both ranks' blobs, in the coordinator's manifest
    assert {b["key"] for b in files["__1_0.distcp"]["blobs"]} == {"rank1.w", "rank1.lr"}
    assert verify_checkpoint(CheckpointStore(str(root)), "step-000000005").ok
    # .metadata is stock DCP: it unpickles without overlapckpt's classes, and loads.
    import torch.distributed.checkpoint as dcp

    target = {"rank1": {"w": torch.zeros(64), "lr": 0.0}}
    dcp.load(target, checkpoint_id=str(root / "step-000000005"), no_dist=True)
    assert torch.equal(target["rank1"]["w"], torch.full((64,), 2.0)) and target["rank1"]["lr"] == 0.02
    lr_blob = [b for b in files["__1_0.distcp"]["blobs"] if b["key"] == "rank1.lr"][0]
    with _flipped(root / "step-000000005" / "__1_0.distcp", lr_blob["offset"] + 40, 0x04):
        report = verify_checkpoint(CheckpointStore(str(root)), "step-000000005")
    assert report.problems == [
        f"checksum mismatch for 'rank1.lr' in {root}/step-000000005/__1_0.distcp "
        f"(bytes {lr_blob['offset']}..{lr_blob['offset'] + lr_blob['length']})"
    ]


def test_missing_manifest_is_corrupt_and_skipped(run):
    root, _ = run
    (root / STEP3 / MANIFEST_NAME).unlink()
    with pytest.raises(CorruptCheckpointError, match="has no overlapckpt.json"):
        read_manifest(CheckpointStore(str(root)), STEP3)
    with pytest.warns(UserWarning, match="skipping"):
        assert [i.step for i in list_checkpoints(str(root))] == [1]
    (root / STEP1 / MANIFEST_NAME).unlink()
    with pytest.warns(UserWarning), pytest.raises(CheckpointNotFoundError, match="damaged manifest"):
        load(str(root), *_fresh())


def _rewrite_manifest(root: Path, edit) -> None:
    """Edit the manifest's document and write it back with a valid self-checksum: the damage is past it."""
    path = root / STEP3 / MANIFEST_NAME
    document = json.loads(path.read_bytes())
    document.pop("manifest_crc32")
    edit(document)
    path.write_bytes(dump_manifest(document))


def test_a_serialization_fault_is_caught_end_to_end(run, capsys, hashing):
    # The stored bytes match their checksums, but what they decode to is not the snapshot
    # that was saved: only the per-tensor checksum of the host snapshot sees it.
    root, refs = run

    def wrong_weight_sum(document: dict[str, Any]) -> None:
        item = document["items"]["model.inp.weight"]
        item["checksum"] = f"{int(item['checksum'], 16) ^ 1:08x}"

    _rewrite_manifest(root, wrong_weight_sum)
    model, opt = _fresh()
    before = model.inp.weight.detach().clone()
    with pytest.raises(CorruptCheckpointError, match=r"'model.inp.weight': the tensor read back differs from the snapshot"):
        load(str(root), model, opt, step=3)
    assert torch.equal(model.inp.weight, before)  # refused before anything changed
    load(str(root), model, opt, step=3, verify=False)  # the bytes themselves are fine
    assert_state_equal(*refs[3], model, opt)


def test_format_2_tensor_crcs_still_verify(run, capsys):
    # Checkpoints written before format 3 carry zlib CRC-32s as integers: they load, verified.
    root, refs = run
    model, opt = _fresh()
    load(str(root), model, opt, step=3, verify=False)
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from overlapckpt.format.entries import flatten_tensors
    from overlapckpt.format.extra_state import tensor_bytes

    msd, osd = get_state_dict(model, opt)
    # Format 2's tensor checksums: zlib's CRC-32 of each tensor's bytes.
    crcs = {k: zlib.crc32(tensor_bytes(t.contiguous())) for k, t in flatten_tensors({"model": msd, "optimizer": osd}).items()}

    def as_format_2(document: dict[str, Any]) -> None:
        document["format_version"] = 2
        for key, item in document["items"].items():
            del item["checksum"]
            item["crc32"] = crcs[key] ^ (1 if key == "model.out.bias" else 0)

    _rewrite_manifest(root, as_format_2)
    with pytest.raises(CorruptCheckpointError, match=r"'model.out.bias': the tensor read back differs"):
        load(str(root), *_fresh(), step=3)
    _rewrite_manifest(root, lambda d: d["items"]["model.out.bias"].update(crc32=crcs["model.out.bias"]))
    model, opt = _fresh()
    load(str(root), model, opt, step=3)
    assert_state_equal(*refs[3], model, opt)


class _CountingStream:
    def __init__(self, raw: Any, counts: list[tuple[int, int]]) -> None:
        self._raw, self._counts = raw, counts

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._raw.seek(offset, whence)

    def read(self, n: int = -1) -> bytes:
        at = self._raw.tell()
        data = self._raw.read(n)
        self._counts.append((at, len(data)))
        return data

    def readinto(self, buffer: Any) -> int:
        at = self._raw.tell()
        n = self._raw.readinto(buffer)
        self._counts.append((at, n))
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


class ReadCountingStore(CheckpointStore):
    """Records every read of a shard by DCP's reader (its file system's streams), and every verify read."""

    shard_reads: list[tuple[int, int]]

    def make_reader(self, name: str) -> Any:
        reader = super().make_reader(name)
        fs, counts = reader.fs, self.shard_reads

        class CountingFs:
            @contextmanager
            def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
                with fs.create_stream(path, mode) as raw:
                    yield _CountingStream(raw, counts) if str(path).endswith(".distcp") else raw

            def __getattr__(self, attr: str) -> Any:
                return getattr(fs, attr)

        reader.fs = CountingFs()
        return reader

    @contextmanager
    def open_read(self, name: str, filename: str) -> Iterator[BinaryIO]:
        raise AssertionError(f"load read {filename} outside DCP's reader: a second pass")
        yield  # pragma: no cover


def test_a_verified_load_reads_each_stored_byte_once(run, monkeypatch, hashing):
    from overlapckpt.restore import pipeline as loading

    root, refs = run
    store = ReadCountingStore(str(root))
    store.shard_reads = []
    monkeypatch.setattr(loading, "checkpoint_at", lambda path, step, options: (store, STEP3))
    model, opt = _fresh()
    load(str(root), model, opt, step=3)
    assert_state_equal(*refs[3], model, opt)
    # Every blob read once, whole, and nothing else: the shard's bytes exactly once.
    spans = sorted(store.shard_reads)
    assert spans == sorted((b["offset"], b["length"]) for b in _blobs(root))
    assert sum(n for _, n in spans) == (root / STEP3 / SHARD).stat().st_size
