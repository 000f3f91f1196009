"""Blobs located and decoded once per frame: every answer equals tensor_decode's, and only a byte-identical frame is reused."""

from __future__ import annotations

import io
import struct

import pytest
import torch

from overlapckpt.format import blob_frames, tensor_decode
from overlapckpt.format.blob_frames import BlobFrames


@pytest.fixture(autouse=True)
def crc_off():
    """As the writer saves (writer/process.py)."""
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    yield
    torch.serialization.set_crc32_options(before)


@pytest.fixture
def parses(monkeypatch):
    """Counts of the real locate and decode calls made through BlobFrames."""
    counts = {"locate": 0, "decode": 0}

    def counting_locate(view):
        counts["locate"] += 1
        return tensor_decode.locate(view)

    def counting_decode(buffer, record):
        counts["decode"] += 1
        return tensor_decode.decode_in_place(buffer, record)

    monkeypatch.setattr(blob_frames, "locate", counting_locate)
    monkeypatch.setattr(blob_frames, "decode_in_place", counting_decode)
    return counts


def blob_of(tensor: torch.Tensor) -> bytearray:
    out = io.BytesIO()
    torch.save(tensor, out)
    return bytearray(out.getvalue())


def through(frames: BlobFrames, blob: bytearray) -> tuple[tensor_decode.TensorRecord | None, torch.Tensor | None]:
    record = frames.locate(memoryview(blob))
    return record, (frames.decode_in_place(blob, record) if record is not None else None)


def assert_same_as_tensor_decode(blob: bytearray, record, tensor) -> None:
    expected_record = tensor_decode.locate(memoryview(bytearray(blob)))
    assert record == expected_record
    if record is None:
        return
    copy = bytearray(blob)
    expected = tensor_decode.decode_in_place(copy, expected_record)
    if expected is None:
        assert tensor is None
        return
    assert tensor is not None
    assert (tensor.dtype, tensor.shape, tensor.stride(), tensor.requires_grad) == (expected.dtype, expected.shape, expected.stride(), expected.requires_grad)
    assert torch.equal(tensor, expected)
    start = memoryview(blob)[record.data_start :]
    assert tensor.data_ptr() == torch.frombuffer(start, dtype=torch.uint8).data_ptr()  # a view of this blob's own bytes


@pytest.mark.parametrize(
    "make",
    [
        lambda g: torch.randn(4, 4, generator=g),
        lambda g: torch.randn(33, generator=g).to(torch.bfloat16),
        lambda g: torch.randint(0, 100, (), generator=g),
        lambda g: torch.rand(2, 3, 5, generator=g) > 0.5,
    ],
    ids=["float32 4x4", "bfloat16", "int64 scalar", "bool 2x3x5"],
)
def test_one_frame_is_located_and_decoded_once_and_every_answer_equals_tensor_decode(make, parses):
    frames = BlobFrames()
    g = torch.Generator().manual_seed(0)
    blobs = [blob_of(make(g)) for _ in range(8)]
    assert len({bytes(b) for b in blobs}) > 1  # precondition: the data differ
    for blob in blobs:
        record, tensor = through(frames, blob)
        assert_same_as_tensor_decode(blob, record, tensor)
    assert parses == {"locate": 1, "decode": 1}


def test_a_frame_that_differs_in_one_byte_is_parsed_as_itself(parses):
    frames = BlobFrames()
    first = blob_of(torch.randn(4, 4))
    through(frames, first)
    forged = bytearray(blob_of(torch.randn(4, 4)))
    record = tensor_decode.locate(memoryview(forged))
    assert record is not None
    at = forged.index(b"FloatStorage")  # the pickle, inside the frame: the storage type named otherwise
    forged[at : at + 12] = b"IntStorage\x00\x00"
    got_record, tensor = through(frames, forged)
    assert parses["locate"] == 2  # not served from the first frame
    assert_same_as_tensor_decode(forged, got_record, tensor)


def test_a_zip_with_a_comment_is_never_kept(parses):
    frames = BlobFrames()
    for seed in range(3):
        blob = blob_of(torch.randn(5, generator=torch.Generator().manual_seed(seed)))
        assert blob[-22:-18] == b"PK\x05\x06"
        blob[-2:] = struct.pack("<H", 3)  # an archive comment of 3 bytes: zipfile searches back for the end record
        blob += b"abc"
        record, tensor = through(frames, blob)
        assert_same_as_tensor_decode(blob, record, tensor)
    assert parses["locate"] == 3


def test_a_tensor_that_requires_grad_is_decoded_every_time(parses):
    frames = BlobFrames()
    for seed in range(4):
        blob = blob_of(torch.randn(6, generator=torch.Generator().manual_seed(seed)).requires_grad_())
        record, tensor = through(frames, blob)
        assert_same_as_tensor_decode(blob, record, tensor)
    assert parses == {"locate": 1, "decode": 4}
