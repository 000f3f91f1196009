"""The writer's views of its host slots (writer/slot_views.py): made once per slot and plan, the slot's own bytes, dropped with it."""

from __future__ import annotations

import weakref

import torch

from overlapckpt import protocol as p
from overlapckpt.format.entries import TensorEntry
from overlapckpt.writer.slot_views import SlotViews


def _plan(plan_id: int) -> p.SetPlanRequest:
    entries = [
        TensorEntry(key="a", path=("a",), role="param", param_fqn="a", dtype=torch.float32, shape=(2, 3), nbytes=24),
        TensorEntry(key="b", path=("b",), role="param", param_fqn="b", dtype=torch.int64, shape=(2,), nbytes=16),
    ]
    return p.SetPlanRequest(plan_id=plan_id, entries=entries, offsets=(0, 64))


def test_views_are_made_once_per_slot_and_plan_and_see_the_slots_current_bytes():
    views = SlotViews()
    slot = torch.zeros(128, dtype=torch.uint8)
    plan = _plan(1)
    first = views.of(0, slot, plan)
    slot[:24] = torch.arange(6, dtype=torch.float32).view(torch.uint8)  # the next snapshot's bytes
    slot[64:80] = torch.tensor([7, -8]).view(torch.uint8)
    again = views.of(0, slot, plan)
    assert all(a is b for a, b in zip(first, again)) and again is not first  # the same tensors, a new list
    assert torch.equal(again[0], torch.arange(6, dtype=torch.float32).view(2, 3))
    assert torch.equal(again[1], torch.tensor([7, -8]))
    again[0].fill_(1.5)  # a replay writes into the slot through its views
    assert torch.equal(slot[:24].view(torch.float32), torch.full((6,), 1.5))
    assert views.of(0, slot, _plan(2))[0] is not first[0]  # another plan: its own views


def test_a_slot_mapped_again_or_released_keeps_no_view_of_the_old_mapping():
    views = SlotViews()
    plan = _plan(1)
    old = torch.zeros(128, dtype=torch.uint8)
    gone = weakref.ref(views.of(0, old, plan)[0])
    new = torch.ones(128, dtype=torch.uint8)
    fresh = views.of(0, new, plan)  # the same id, another mapping: made again
    assert gone() is None and fresh[1].untyped_storage().data_ptr() == new.data_ptr() + 64
    kept = weakref.ref(fresh[0])
    del fresh
    views.forget_buffer(0)
    assert kept() is None  # released with its slot
    views.of(0, new, plan)
    kept = weakref.ref(views.of(0, new, plan)[0])
    views.forget_plan(1)
    assert kept() is None


def test_a_new_plan_replaces_the_old_plans_views_of_a_slot():
    """Plan ids are never sent again once replaced: a slot keeps one plan's views, not one set per plan ever used."""
    views = SlotViews()
    slot = torch.zeros(128, dtype=torch.uint8)
    old = weakref.ref(views.of(0, slot, _plan(1))[0])
    kept_elsewhere = weakref.ref(views.of(1, torch.zeros(128, dtype=torch.uint8), _plan(1))[0])
    views.of(0, slot, _plan(2))
    assert old() is None and kept_elsewhere() is not None  # only that slot's old plan went


def test_snapshot_checksums_taken_in_the_slot_equal_each_views_own():
    """The writer hashes each entry where it lies in the slot (writer/snapshot_sums.py), not through a wrapper per tensor:
    the small entries at once, the large one on its thread."""
    from overlapckpt.format.manifest import tensor_checksum
    from overlapckpt.hostbuf import exact_view
    from overlapckpt.writer.snapshot_sums import THREADED_MIN_BYTES, SnapshotChecksums

    g = torch.Generator().manual_seed(2)
    large = THREADED_MIN_BYTES // 4  # float32 elements: one entry of exactly the threaded size
    slot = torch.randint(0, 256, (256 + 4 * large,), dtype=torch.uint8, generator=g)
    shapes = [(torch.float32, (3, 4)), (torch.bfloat16, (7,)), (torch.int64, ()), (torch.float32, (0, 3)), (torch.float32, (large,))]
    entries = [
        TensorEntry(key=f"k{i}", path=(f"k{i}",), role="param", param_fqn=None, dtype=dtype, shape=shape, nbytes=torch.empty(shape, dtype=dtype).nbytes)
        for i, (dtype, shape) in enumerate(shapes)
    ]
    plan = p.SetPlanRequest(plan_id=1, entries=entries, offsets=(0, 64, 128, 192, 256))
    for algorithm in ("crc32c", "crc32"):
        expected = [tensor_checksum(exact_view(slot, off, e.dtype, e.shape), algorithm) for e, off in zip(entries, plan.offsets)]
        sums = SnapshotChecksums(slot, [e.nbytes for e in entries], plan.offsets, algorithm)
        try:
            assert sums.all() == expected
            assert sums.of(3) == "00000000"  # an empty tensor, as tensor_checksum says
        finally:
            sums.close()
