"""The hooks' per-tensor passes (tensor_passes.py): the native extension and its Python twins give the same answers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from overlapckpt.train.copying import tensor_passes
from overlapckpt.train.copying.tensor_passes import DataPointers, grads_of, same_dict_contents, same_items

from tensor_roads import ROADS, can_build, take_road


@pytest.fixture(params=ROADS)
def road(request, monkeypatch):
    take_road(request.param, monkeypatch)
    return request.param


def test_same_items_compares_identity_never_values(road):
    a, b = torch.tensor(1.0), torch.tensor(2.0)
    assert same_items([a, b], [a, b])
    # An equal 0-dim tensor is another object: a == here would call Tensor.__eq__ and say True.
    assert not same_items([a, b.clone()], [a, b])
    assert not same_items([a], [a, b])
    assert not same_items([a, b, a], [a, b])
    assert same_items([], [])


def test_same_dict_contents_sees_a_replaced_value_a_new_entry_and_a_value_moved_between_dicts(road):
    x, y, z = torch.zeros(2), torch.ones(2), torch.full((2,), 2.0)
    first, second = {"x": x, "y": y}, {"z": z}
    captured = ([first, second], [2, 1], [x, y, z])
    assert same_dict_contents(*captured)
    first["y"] = y.clone()
    assert not same_dict_contents(*captured)
    first["y"] = y
    second["w"] = x
    assert not same_dict_contents(*captured)
    del second["w"]
    assert same_dict_contents(*captured)
    # y moved to the front of the second dict: the chained values are the same objects in the same order.
    del first["y"]
    second.clear()
    second.update({"y": y, "z": z})
    assert not same_dict_contents(*captured)
    assert same_dict_contents([first, second], [1, 2], [x, y, z])
    assert not same_dict_contents([first, second], [1, 2], [x, y])
    assert not same_dict_contents([first, second], [1, 2, 0], [x, y, z])


def test_data_pointers_see_new_storage_and_nothing_else(road):
    base = torch.arange(8.0)
    tensors = [nn.Parameter(torch.zeros(3)), base[2:5], torch.tensor(1.0)]
    pointers = DataPointers(tensors)
    assert pointers.values == [t.data_ptr() for t in tensors]
    assert pointers.unchanged(tensors)
    with torch.no_grad():
        tensors[0].add_(1.0)  # in place: same storage
    assert pointers.unchanged(tensors)
    tensors[0].data = torch.zeros(3)  # the same Parameter object, other storage
    assert not pointers.unchanged(tensors)
    assert not DataPointers(tensors).unchanged(tensors[:2])


class _GradFromElsewhere(torch.Tensor):
    """A subclass answering .grad its own way: every road must ask it, not read torch's field."""

    @property
    def grad(self):  # type: ignore[override]
        return "asked"


def test_grads_of_returns_the_very_gradient_objects_and_asks_subclasses(road):
    params = [nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(3)), torch.zeros(1, requires_grad=True)]
    params[0].grad = torch.ones(2)
    params[2].grad = torch.ones(1)
    grads = grads_of(params)
    assert grads[0] is params[0].grad and grads[1] is None and grads[2] is params[2].grad
    odd = torch.Tensor._make_subclass(_GradFromElsewhere, torch.zeros(2))
    assert grads_of([params[0], odd]) == [params[0].grad, "asked"]


def test_the_native_passes_refuse_arguments_of_the_wrong_type(monkeypatch):
    take_road("native", monkeypatch)
    native = tensor_passes.passes()
    assert native is not None
    with pytest.raises(TypeError, match="items must be a list, not tuple"):
        native.same_items((1,), [1])
    with pytest.raises(TypeError, match=r"dicts\[1\] must be a dict, not list"):
        native.same_dict_contents([{}, []], [0, 0], [])
    with pytest.raises(TypeError, match="expected must be a 1-dim contiguous int64 CPU tensor"):
        native.data_ptrs_equal([torch.zeros(1)], torch.zeros(1))
    with pytest.raises(AttributeError, match="data_ptr"):
        native.data_ptrs_equal([object()], torch.zeros(1, dtype=torch.int64))
    with pytest.raises(AttributeError, match="grad"):
        native.grads_of([object()])
    # torch's own error for a tensor with no storage, as Tensor.data_ptr() raises it, not an abort.
    with pytest.raises(RuntimeError, match="storage"):
        native.data_ptrs_equal([torch.zeros(2, 2).to_sparse()], torch.zeros(1, dtype=torch.int64))


def test_the_extension_is_built_per_torch_and_never_loaded_when_disabled(monkeypatch, tmp_path):
    if not can_build():
        pytest.skip("no C++ compiler or Python headers here")
    built = tensor_passes.build()
    assert built is not None and built == tensor_passes.library_path()
    monkeypatch.setattr(torch, "__version__", "0.0.0+another")
    # Another torch's build lands in a cache of the test's own: the shared one never holds a
    # build keyed on a version that is not installed (a later run would load it as that one's).
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    another = tensor_passes.library_path()
    assert another is not None and another != built  # another torch never loads this one's build
    monkeypatch.setattr(tensor_passes, "_loaded", {})
    monkeypatch.setattr(tensor_passes, "_background_builds", {})
    assert tensor_passes.passes() is None  # none built for it: the twins run while it builds in the background
    tensor_passes._background_builds["0.0.0+another"].join(timeout=600)
    assert not tensor_passes._background_builds["0.0.0+another"].is_alive()
    assert [p.name for p in (tmp_path / "cache" / "overlapckpt").iterdir() if p.suffix == ".so"] == [another.name]
    assert tensor_passes.passes() is not None and tensor_passes.passes().__file__ == str(another)  # taken up once built
    monkeypatch.undo()
    monkeypatch.setattr(tensor_passes, "_loaded", {})
    monkeypatch.setenv("OVERLAPCKPT_NATIVE", "0")
    assert tensor_passes.passes() is None
    monkeypatch.delenv("OVERLAPCKPT_NATIVE")
    assert tensor_passes.passes() is not None and tensor_passes.passes().__file__ == str(built)
