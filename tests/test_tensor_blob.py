"""DCP's per-item torch.save of small tensors, written from templates: every blob byte for byte torch.save's own.

Each blob is compared with ``torch.save`` of the same tensor into memory. The counts of
real ``torch.save`` calls show which road a tensor took: a template serves a key only
after its real blobs matched it, and anything torch.save frames differently takes
torch.save itself.
"""

from __future__ import annotations

import io
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import filesystem

from overlapckpt import Checkpointer, list_checkpoints
from overlapckpt.format import tensor_blob
from overlapckpt.format.checksumming_stream import ChecksummingStream
from overlapckpt.format.tensor_blob import SMALL_TENSOR_MAX_BYTES, VERIFY_SAMPLES, TensorBlobTemplates


@pytest.fixture
def crc_off():
    """The writer process's setting (writer/process.py): torch.save's zip CRCs off."""
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    yield
    torch.serialization.set_crc32_options(before)


@pytest.fixture
def real_saves(monkeypatch):
    """Fresh templates, and a count of the real torch.save calls made through the template road."""
    calls: list[object] = []
    real = tensor_blob._TORCH_SAVE

    def counting_save(obj, f, *args, **kwargs):
        calls.append(obj)
        return real(obj, f, *args, **kwargs)

    monkeypatch.setattr(tensor_blob, "_TORCH_SAVE", counting_save)
    monkeypatch.setattr(tensor_blob, "_templates", TensorBlobTemplates())
    return calls


class NoCloseWriter:
    """What DCP's _write_item hands torch.save: a wrapper whose .raw is the stream."""

    def __init__(self, raw: ChecksummingStream) -> None:
        self.raw = raw

    def write(self, data) -> int:
        return self.raw.write(data)

    def flush(self) -> None:
        self.raw.flush()


def torch_saved(tensor: torch.Tensor) -> bytes:
    out = io.BytesIO()
    torch.save(tensor, out)
    return out.getvalue()


def write_through_the_stream(tensors: list[torch.Tensor]) -> list[bytes]:
    """Each tensor saved as DCP saves an item, into one checksumming stream: the blobs, cut at tell()."""
    raw = io.BytesIO()
    stream = ChecksummingStream(raw, "crc32c")
    spans = []
    for t in tensors:
        start = stream.tell()
        tensor_blob.save(t, NoCloseWriter(stream))
        spans.append((start, stream.tell()))
    data = raw.getvalue()
    return [data[a:b] for a, b in spans]


KINDS = {
    "float32 matrix": lambda g: torch.randn(4, 4, generator=g),
    "bfloat16 vector": lambda g: torch.randn(37, generator=g).to(torch.bfloat16),
    "int64 scalar": lambda g: torch.randint(0, 1 << 40, (), generator=g),
    "bool": lambda g: torch.rand(9, generator=g) > 0.5,
    "transposed (strides (1, 5))": lambda g: torch.randn(3, 5, generator=g).t(),
    "a view at storage offset 2": lambda g: torch.randn(10, generator=g)[2:],
    "requires_grad": lambda g: torch.randn(6, generator=g).requires_grad_(),
    "just under the limit": lambda g: torch.randn(SMALL_TENSOR_MAX_BYTES // 4 - 1, generator=g),
}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_templated_blobs_equal_torch_save_byte_for_byte(kind, crc_off, real_saves):
    g = torch.Generator().manual_seed(0)
    tensors = [KINDS[kind](g) for _ in range(6)]
    assert len({torch_saved(t) for t in tensors}) == 6  # precondition: the data differ, so the blobs do
    blobs = write_through_the_stream(tensors)
    assert blobs == [torch_saved(t) for t in tensors]
    # One save to take the template, VERIFY_SAMPLES to check it; the rest came from it.
    assert len(real_saves) == 1 + VERIFY_SAMPLES
    (template,) = tensor_blob._templates._templates.values()
    assert template is not None and template.verified == VERIFY_SAMPLES


def test_tensors_of_one_shape_but_other_strides_or_dtypes_take_their_own_templates(crc_off, real_saves):
    g = torch.Generator().manual_seed(1)
    tensors = [torch.randn(4, 6, generator=g), torch.randn(6, 4, generator=g).t(), torch.randn(4, 6, generator=g).double()] * 4
    assert write_through_the_stream(tensors) == [torch_saved(t) for t in tensors]
    assert len(tensor_blob._templates._templates) == 3


class SubTensor(torch.Tensor):
    pass


OTHERS = {
    "a Parameter": lambda: nn.Parameter(torch.randn(3)),
    "a tensor subclass": lambda: torch.randn(3).as_subclass(SubTensor),
    "a Python attribute": lambda: _with_attribute(torch.randn(3)),
    "1 MiB of storage": lambda: torch.randn(SMALL_TENSOR_MAX_BYTES // 4),
    "a conjugate view": lambda: torch.randn(3, dtype=torch.complex64).conj(),
    "no bytes": lambda: torch.empty(0),
    "a nested tensor": lambda: torch.nested.nested_tensor([torch.randn(2), torch.randn(3)]),
    "not a tensor": lambda: {"a": 1},
}


def _with_attribute(t: torch.Tensor) -> torch.Tensor:
    t.note = "pickled with the tensor"  # type: ignore[attr-defined]
    return t


@pytest.mark.parametrize("kind", sorted(OTHERS))
def test_what_torch_save_frames_otherwise_takes_torch_save_each_time(kind, crc_off, real_saves):
    objects = [OTHERS[kind]() for _ in range(5)]
    blobs = write_through_the_stream(objects)
    for obj, blob in zip(objects, blobs):
        out = io.BytesIO()
        torch.save(obj, out)
        assert blob == out.getvalue()
    assert len(real_saves) == 5 and tensor_blob._templates._templates == {}


def test_with_the_zip_crcs_on_every_tensor_takes_torch_save(real_saves):
    # With torch.save's CRCs on, the zip headers carry each record's CRC: the frame depends on the data.
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(True)
    try:
        g = torch.Generator().manual_seed(2)
        tensors = [torch.randn(5, generator=g) for _ in range(6)]
        blobs = write_through_the_stream(tensors)
        assert blobs == [torch_saved(t) for t in tensors]
    finally:
        torch.serialization.set_crc32_options(before)
    assert len(real_saves) == 6 and tensor_blob._templates._templates == {}


def test_a_frame_that_depends_on_the_data_is_caught_though_the_first_tensors_are_equal(real_saves):
    # The CRCs on, but the key told they are off (what a torch whose frame depends on the data
    # would look like): three equal tensors of zeros cannot check a frame; the fourth, other
    # data, does, and finds it wrong. Checked against equal data, the fourth would be written
    # from a wrong frame.
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(True)
    try:
        tensors = [torch.zeros(5), torch.zeros(5), torch.zeros(5), torch.randn(5), torch.randn(5)]
        templates = tensor_blob._templates
        key = TensorBlobTemplates.key_of(tensors[0], (False, 64))
        blobs = [templates.blob(t, key) for t in tensors]
        assert blobs[:4] == [torch_saved(t) for t in tensors[:4]]
    finally:
        torch.serialization.set_crc32_options(before)
    assert templates._templates[key] is None and blobs[4] is None  # the key is settled: torch.save from now on
    assert len(real_saves) == 4


class OffByOneTemplates(TensorBlobTemplates):
    """A template that is wrong on purpose: its frame loses the last byte of the suffix."""

    @staticmethod
    def _template_from(real, tensor):
        template = TensorBlobTemplates._template_from(real, tensor)
        assert template is not None
        template.suffix = template.suffix[:-1]
        return template


def test_a_wrong_template_is_caught_by_its_first_check_and_never_written(crc_off, real_saves, monkeypatch):
    monkeypatch.setattr(tensor_blob, "_templates", OffByOneTemplates())
    g = torch.Generator().manual_seed(3)
    tensors = [torch.randn(7, generator=g) for _ in range(5)]
    assert write_through_the_stream(tensors) == [torch_saved(t) for t in tensors]
    assert len(real_saves) == 5
    assert list(tensor_blob._templates._templates.values()) == [None]


def test_only_overlapckpts_streams_take_the_template_road(crc_off, real_saves):
    g = torch.Generator().manual_seed(4)
    tensors = [torch.randn(3, generator=g) for _ in range(5)]
    for t in tensors:
        out = io.BytesIO()
        tensor_blob.save(t, out)  # a plain file object: torch.save as it is
        assert out.getvalue() == torch_saved(t)
    assert len(real_saves) == 5 and tensor_blob._templates._templates == {}


def test_install_swaps_torch_save_for_dcps_filesystem_module_only(monkeypatch, crc_off):
    monkeypatch.setattr(filesystem, "torch", torch)  # restored after the test
    assert tensor_blob.install() and tensor_blob.install()  # idempotent
    assert filesystem.torch.save is tensor_blob.save
    assert filesystem.torch.Tensor is torch.Tensor and filesystem.torch.device is torch.device
    assert torch.save is tensor_blob._TORCH_SAVE  # everyone else's torch.save is torch's


def test_the_writer_process_commits_many_small_tensors_that_are_torch_saves_byte_for_byte(tmp_path, crc_off):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(3, 3) for _ in range(150)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(2, 3)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    with Checkpointer(model, opt, tmp_path) as ckpt:
        ckpt.request()
        ckpt.step()
        (info,) = ckpt.wait(timeout_s=120)
    assert [i.step for i in list_checkpoints(tmp_path)] == [info.step]
    reader = dcp.FileSystemReader(info.path)
    metadata = reader.read_metadata()
    blobs = 0
    for index, storage in metadata.storage_data.items():
        meta = metadata.state_dict_metadata[index.fqn]
        if not hasattr(meta, "chunks"):
            continue  # bytes items (non-tensor state)
        with open(os.path.join(info.path, storage.relative_path), "rb") as f:
            f.seek(storage.offset)
            blob = f.read(storage.length)
        tensor = torch.load(io.BytesIO(blob), weights_only=True)
        assert blob == torch_saved(tensor), index.fqn  # what DCP would have stored
        blobs += 1
    assert blobs >= 900  # 150 layers x 2 parameters x (parameter, exp_avg, exp_avg_sq)
    # And stock DCP loads it, bit for bit.
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    loaded = {k: torch.zeros_like(v) for k, v in expected.items()}
    dcp.load({"model": loaded}, checkpoint_id=info.path)
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)


class TrickleStream(io.RawIOBase):
    """A raw stream that takes at most 7 bytes a write (as a pipe or socket may), and counts flushes."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.flushes = 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        taken = bytes(b[:7])
        self.data += taken
        return len(taken)

    def flush(self) -> None:
        self.flushes += 1


def test_a_stream_that_takes_part_of_a_write_gets_the_whole_blob_then_a_flush(crc_off, real_saves):
    g = torch.Generator().manual_seed(5)
    tensors = [torch.randn(6, generator=g) for _ in range(4)]
    raw = TrickleStream()
    stream = ChecksummingStream(raw, "crc32c")
    for t in tensors:
        flushes = raw.flushes
        tensor_blob.save(t, NoCloseWriter(stream))
        assert raw.flushes > flushes  # as torch.save ends
    assert len(real_saves) == 1 + VERIFY_SAMPLES  # the last one from its template
    assert bytes(raw.data) == b"".join(torch_saved(t) for t in tensors)
