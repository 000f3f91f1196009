"""Host-resident state (Adam's step counters on CUDA) copied in one grouped operation, bit for bit."""

from __future__ import annotations

import ctypes
import math
import shutil

import pytest
import torch

from overlapckpt.hostbuf import view_bytes
from overlapckpt.train.copying import native
from overlapckpt.train.copying.host_values import HostValues

ROADS = ["native", "python"]


def _on_road(copy: HostValues, road: str) -> HostValues:
    assert copy._scalars is not None
    if road == "python":
        copy._scalars._native = None  # the twin
    elif not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler here: the native helper cannot be built")
    else:
        assert copy._scalars._native is not None, "a C compiler is on this machine, yet the native helper was not built"
    return copy


def _slot_views(values: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Destinations laid out as a plan lays them: each on a 64-byte boundary of one host buffer."""
    buffer = torch.full((64 * len(values),), 0xA5, dtype=torch.uint8)
    return buffer, [view_bytes(buffer, 64 * k, v.dtype, tuple(v.shape)) for k, v in enumerate(values)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(1).view(torch.uint8)


@pytest.mark.parametrize("road", ROADS)
def test_single_element_values_of_every_plain_dtype_arrive_bit_for_bit(road):
    cases = {
        torch.float32: [0.0, -0.0, 1.5, 3.4e38, -1e-45, math.inf, -math.inf, math.nan, 16777217.0],
        torch.float64: [0.1, -0.0, 1e308, 5e-324, math.nan],
        torch.bfloat16: [1.0, -0.0, 3.0e38],
        torch.int64: [0, -1, 2**62 + 1, -(2**63)],
        torch.int32: [7, -(2**31)],
        torch.bool: [True, False],
    }
    for dtype, numbers in cases.items():
        sources = [torch.tensor(x, dtype=dtype) for x in numbers]
        _, destinations = _slot_views(sources)
        copy = _on_road(HostValues(sources, destinations), road)  # the grouped road, not a copy per tensor
        held = copy.read(sources)
        for s in sources:
            s.fill_(0)  # the next optimizer step: the values read before it must be the ones written
        copy.write(held)
        for d, x in zip(destinations, numbers):
            assert torch.equal(_bits(d), _bits(torch.tensor(x, dtype=dtype))), (dtype, x)


@pytest.mark.parametrize("road", ROADS)
def test_a_write_touches_only_the_destinations(road):
    sources = [torch.tensor(float(k)) for k in range(5)]
    buffer, destinations = _slot_views(sources)
    before = buffer.clone()
    copy = _on_road(HostValues(sources, destinations), road)
    copy.copy_now(sources)
    changed = (buffer != before).nonzero().flatten().tolist()
    assert set(changed) <= {64 * k + b for k in range(5) for b in range(4)}
    assert [d.item() for d in destinations] == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_mixed_or_larger_values_take_the_per_tensor_road_and_are_exact_too():
    sources = [torch.tensor(1.0), torch.tensor(2, dtype=torch.int64), torch.arange(6, dtype=torch.float32).reshape(2, 3)]
    _, destinations = _slot_views(sources)
    copy = HostValues(sources, destinations)
    assert copy._scalars is None
    held = copy.read(sources)
    for s in sources:
        s.zero_()
    copy.write(held)
    assert torch.equal(destinations[0], torch.tensor(1.0))
    assert torch.equal(destinations[1], torch.tensor(2))
    assert torch.equal(destinations[2], torch.arange(6, dtype=torch.float32).reshape(2, 3))


def test_a_source_that_requires_grad_is_read_without_recording_autograd():
    sources = [torch.tensor(2.0, requires_grad=True), torch.tensor(3.0, requires_grad=True)]
    _, destinations = _slot_views(sources)
    HostValues(sources, destinations).copy_now(sources)
    assert [d.item() for d in destinations] == [2.0, 3.0]
    assert all(not d.requires_grad and d.grad_fn is None for d in destinations)


def test_a_value_whose_storage_moved_is_read_from_its_new_storage_not_the_recorded_address():
    sources = [torch.tensor(1.0), torch.tensor(2.0), torch.tensor(3.0)]
    _, destinations = _slot_views(sources)
    copy = _on_road(HostValues(sources, destinations), "native")
    copy.copy_now(sources)
    old = sources[1].data
    sources[1].data = torch.tensor(20.0)  # new storage; the old one still lives (held here) with 2.0
    copy.copy_now(sources)
    assert [d.item() for d in destinations] == [1.0, 20.0, 3.0]
    assert old.item() == 2.0


def test_the_native_helper_builds_where_a_compiler_exists_and_is_skipped_when_disabled(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(native._gather, "_loaded", {})
    if shutil.which("cc") or shutil.which("gcc"):
        built = native.build()
        assert built is not None and built.parent == tmp_path / "overlapckpt" and built.is_file()
        assert native.gather_library() is not None
    monkeypatch.setattr(native._gather, "_loaded", {})
    monkeypatch.setenv("OVERLAPCKPT_NATIVE", "0")
    assert native.gather_library() is None
    sources = [torch.tensor(4.0), torch.tensor(5.0)]
    _, destinations = _slot_views(sources)
    HostValues(sources, destinations).copy_now(sources)  # the twin
    assert [d.item() for d in destinations] == [4.0, 5.0]


def test_a_failed_build_leaves_no_file_and_falls_back(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a compiler that fails
    monkeypatch.setattr(native._gather, "_loaded", {})
    assert native.build() is None
    assert native.gather_library() is None
    assert list((tmp_path / "overlapckpt").iterdir()) == []


def test_the_native_gather_keeps_the_gil():
    """Loaded as a PyDLL: a call of microseconds inside optimizer.step() must not release the GIL and then
    wait up to the switch interval (5 ms) for another Python thread to hand it back."""
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler here: the native helper cannot be built")
    library = native.gather_library()
    assert isinstance(library, ctypes.PyDLL), type(library)
