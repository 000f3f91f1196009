"""The copier over the emulated device: CUDA's placement, allocator and streams, and what they expose.

The emulated device must behave as CUDA does where a checkpoint's correctness depends on
it, or the CPU tests prove nothing about the GPU; the first tests check the emulator
itself. The others are the CUDA defects a reading of the copier found, each reproduced
here on the device the GPU's logic now runs on in every CPU test.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from overlapckpt import load
from overlapckpt.seams import Checkpointer
from overlapckpt.train.copying.device import TensorRun
from overlapckpt.train.copying.emulated_device import POISON_BYTE, EmulatedDevice, torch_cuda_placement
from overlapckpt.train.copying.stream_copier import StreamCopier
from overlapckpt.train.copying.transfer import FenceResult

POISON_FP32 = torch.tensor([POISON_BYTE] * 4, dtype=torch.uint8).view(torch.float32).item()


# ---- the emulator ---------------------------------------------------------------------------------


def test_a_fresh_allocation_holds_garbage_and_freed_memory_goes_to_the_next_allocation_on_its_stream():
    dev = EmulatedDevice("held")
    first = dev.empty(1024)
    assert torch.equal(first, torch.full((1024,), POISON_BYTE, dtype=torch.uint8))  # never zeros
    first.fill_(7)
    address = first.data_ptr()
    del first  # freed on the host's stream: poisoned and handed out again at once
    second = dev.empty(1000)
    assert second.data_ptr() == address
    assert int(second.min()) == int(second.max()) == POISON_BYTE
    assert dev.memory_allocated() == 1024 and dev.max_memory_allocated() == 1024
    side = dev.new_stream()
    with dev.stream_context(side):
        third = dev.empty(1024)
    assert third.data_ptr() != address  # another stream's cache
    dev.close()


def test_memory_freed_before_a_held_copy_ran_is_overwritten_on_every_run():
    # The caching allocator's contract: memory freed on the host's stream may be reused at
    # once, so a copy queued on another stream must hold what it reads.
    dev = EmulatedDevice("held")
    side = dev.new_stream()
    source = dev.empty(16).view(torch.float32)
    source.fill_(3.0)
    destination = torch.zeros(4)
    with dev.stream_context(side):
        dev.copy_([destination], [source])
        done = dev.record_event(side)
    del source  # released too early: the copy has not run
    dev.synchronize_event(done)
    assert torch.equal(destination, torch.full((4,), POISON_FP32))
    dev.close()


def test_a_device_side_wait_on_a_side_stream_orders_it_after_the_event():
    dev = EmulatedDevice("held")
    a, b = dev.new_stream(), dev.new_stream()
    x = torch.zeros(4)
    y = torch.zeros(4)
    with dev.stream_context(a):
        dev.copy_([x], [torch.ones(4)])
    dev.wait_stream(b, a)
    with dev.stream_context(b):
        dev.copy_([y], [x])
        done = dev.record_event(b)
    assert not dev.event_done(done) and torch.equal(x, torch.zeros(4))  # held: nothing ran
    dev.synchronize_event(done)  # b's wait released a's copy first
    assert torch.equal(y, torch.ones(4))
    dev.close()


def test_registration_is_checked_as_cuda_checks_it():
    dev = EmulatedDevice()
    assert dev.register_host(4096, 8192) == 0
    assert dev.register_host(8192, 64) == 712  # overlaps: cudaErrorHostMemoryAlreadyRegistered
    assert dev.unregister_host(4096) == 0
    assert dev.unregister_host(4096) == 713  # cudaErrorHostMemoryNotRegistered


def test_torch_cuda_placement_keeps_the_step_of_a_non_fused_adam_on_the_host():
    model = nn.Linear(4, 4)
    foreach = torch.optim.AdamW(model.parameters(), foreach=True)
    fused = torch.optim.AdamW(model.parameters(), fused=True)
    for opt in (foreach, fused):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
    on_host = torch_cuda_placement(foreach)
    assert on_host(foreach.state[model.weight]["step"]) and not on_host(foreach.state[model.weight]["exp_avg"])
    assert not on_host(model.weight)
    assert not torch_cuda_placement(fused)(fused.state[model.weight]["step"])


# ---- the defects ----------------------------------------------------------------------------------


def _loop(model, opt, x):
    def step():
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _state(model, opt):
    return (
        {k: v.clone() for k, v in model.state_dict().items()},
        {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in model.named_parameters()},
    )


def _restored(path, make, step=None):
    model, opt = make()
    model(torch.zeros(1, model[0].in_features)).sum().backward()
    opt.step()  # creates the state load() reads into
    opt.zero_grad(set_to_none=True)
    load(str(path), model, opt, step=step)
    return _state(model, opt)


def _differences(got, expected):
    (gm, go), (em, eo) = got, expected
    out = [k for k in em if not torch.equal(gm[k], em[k])]
    out += [f"{n}.{k}" for n in eo for k in eo[n] if not torch.equal(go[n][k], eo[n][k])]
    return out


def _small_adamw():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)


def test_host_resident_step_counters_survive_the_packed_device_copy(tmp_path):
    # AdamW (foreach) on CUDA keeps each parameter's step on the host; every entry here is
    # small, so the group goes as one packed span whose DMA also covers the step counters'
    # bytes. Written at the call, they were then overwritten with the scratch's garbage.
    model, opt = _small_adamw()
    x = torch.randn(16, 8)
    step = _loop(model, opt, x)
    for _ in range(4):
        step()
    placement = torch_cuda_placement(opt)
    assert placement(opt.state[model[0].bias]["step"]) and not placement(model[0].bias)  # interleaved in the slot
    dev = EmulatedDevice("held", host_resident=placement)
    with Checkpointer(model, opt, tmp_path, copier=StreamCopier(dev)) as ckpt:
        step()
        ckpt.request()
        expected = _state(model, opt)
        step()
        step()
        (info,) = ckpt.wait(timeout_s=120)
    assert info.step == 1 and expected[1]["0.bias"]["step"].item() == 5.0  # the Checkpointer counts its own steps
    assert _differences(_restored(tmp_path, _small_adamw), expected) == []


def _replay_model():
    torch.manual_seed(0)
    # Four layers of 256 KiB, one per copy group at W=4; above the packing size, so the
    # device memory a step holds is its gradient clones.
    model = nn.Sequential(*[nn.Linear(256, 256, bias=False) for _ in range(4)])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)


def test_replay_frees_each_gradient_clone_when_its_own_copy_lands(tmp_path):
    layer_bytes = 256 * 256 * 4
    x = torch.randn(8, 256)
    twin_model, twin_opt = _replay_model()
    twin = _loop(twin_model, twin_opt, x)
    for _ in range(4):
        twin()
    expected = _state(twin_model, twin_opt)  # version 4: requested after 1, window 4

    model, opt = _replay_model()
    step = _loop(model, opt, x)
    # Eager: every copy has landed by the next poll, so a clone lives only until its ticket is read.
    dev = EmulatedDevice("eager", clone_is_cheap=True)
    with Checkpointer(model, opt, tmp_path, window=4, consistency="replay", copier=StreamCopier(dev)) as ckpt:
        step()
        ckpt.request()
        ckpt.step()
        dev.reset_peak()
        held_before = dev.memory_allocated()
        for _ in range(3):
            step()
            ckpt.step()
        window_peak = dev.max_memory_allocated() - held_before
        (info,) = ckpt.wait(timeout_s=120)
    assert info.step == 4
    assert window_peak >= 3 * layer_bytes  # the precondition: step 4 clones groups 0..2 at once
    # One step's clones at a time; held until the window landed they were 1 + 2 + 3 layers.
    assert window_peak < 4 * layer_bytes, window_peak
    assert _differences(_restored(tmp_path, _replay_model), expected) == []


def test_a_request_outside_the_training_stream_still_waits_for_it(tmp_path):
    # The loop trains under a stream of its own; request() is called outside that context.
    # Work still queued on the training stream (here a write to the weights, as an update
    # kernel the device has not run yet) must land before the copy reads.
    model, opt = _small_adamw()
    x = torch.randn(16, 8)
    step = _loop(model, opt, x)
    step()
    dev = EmulatedDevice("held")
    training = dev.new_stream()
    with Checkpointer(model, opt, tmp_path, copier=StreamCopier(dev)) as ckpt:
        with dev.stream_context(training):
            step()  # the hooks run inside the training stream's context
            weight = model[0].weight.detach()
            training.enqueue(lambda: weight.add_(1.0))
        expected_weight = model[0].weight.detach().clone() + 1.0
        ckpt.request()
        (info,) = ckpt.wait(timeout_s=120)
    assert info.step == 1
    got, _ = _restored(tmp_path, _small_adamw)
    assert torch.equal(got["0.weight"], expected_weight)


def test_stream_copier_fences_a_held_copy_on_the_training_stream():
    dev = EmulatedDevice("held")
    copier = StreamCopier(dev)
    src, dst = torch.arange(8.0), torch.zeros(8)
    ticket = copier.copy_async([src], [dst])
    assert not copier.poll(ticket)
    assert copier.fence_compute(ticket) == FenceResult.WAITED_IN_FLIGHT
    assert torch.equal(dst, src) and copier.poll(ticket)
    assert copier.fence_compute(ticket) == FenceResult.NOT_NEEDED
    copier.close()


@pytest.mark.parametrize("schedule", ["async", "held", "eager"])
def test_every_schedule_lands_the_same_bytes(schedule):
    dev = EmulatedDevice(schedule, host_resident=lambda t: t.dtype == torch.int64)
    copier = StreamCopier(dev)
    host_buffer = torch.zeros(64, dtype=torch.uint8)
    sources = [torch.arange(4, dtype=torch.float32), torch.tensor([9], dtype=torch.int64), torch.arange(2, dtype=torch.float32)]
    views = [host_buffer[0:16].view(torch.float32), host_buffer[16:24].view(torch.int64), host_buffer[24:32].view(torch.float32)]
    ticket = copier.copy_async(sources, views)
    sources[1].fill_(5)  # the host writes its own state on: the copy holds the value at the call
    copier.wait(ticket)
    assert [v.tolist() for v in views] == [[0.0, 1.0, 2.0, 3.0], [9], [0.0, 1.0]]
    copier.close()


# ---- copy routes: the per-tensor work of a group's copy done once per plan ------------------------


class ViewCountingDevice(EmulatedDevice):
    """Counts the per-tensor device views it makes and the copy launches it is asked for."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.views_made = 0
        self.launches = 0

    def _device_views(self, tensors):
        self.views_made += len(tensors)  # each looked up (in C) and viewed where it is a device block
        return super()._device_views(tensors)

    def copy_(self, destinations, sources):
        self.launches += bool(sources)
        super().copy_(destinations, sources)


def _route_case(dev):
    host_buffer = torch.zeros(256, dtype=torch.uint8)
    sources = [torch.arange(4, dtype=torch.float32), torch.tensor([9], dtype=torch.int64), torch.arange(2, dtype=torch.float32)]
    sources += [torch.full((3,), float(k)) for k in range(8)]
    views, cursor = [], 0
    for s in sources:
        views.append(host_buffer[cursor : cursor + s.numel() * s.element_size()].view(s.dtype))
        cursor += 16
    return sources, views


@pytest.mark.parametrize("schedule", ["async", "held", "eager"])
def test_a_routed_copy_lands_the_same_bytes_step_after_step(schedule):
    # The route is made once; each copy along it must land the sources of its own call: the
    # same tensors written in place (the live state), and other tensors of the same shapes
    # (the next step's gradients), with a host-resident value written after the packed DMA.
    dev = ViewCountingDevice(schedule, host_resident=lambda t: t.dtype == torch.int64)
    copier = StreamCopier(dev)
    sources, views = _route_case(dev)
    route = copier.route(sources, views, keep_sources=True)
    assert route is not None and route.scratch is not None and route.host_deferred_indices == (1,)
    for step in range(3):
        for s in sources:
            s.add_(1)  # the optimizer's in-place update
        expected = [s.clone() for s in sources]
        ticket = copier.copy_async(sources, views, route=route)
        sources[1].fill_(-1)  # the host writes its own state on: the copy holds the value at the call
        copier.wait(ticket)
        assert [torch.equal(v, e) for v, e in zip(views, expected)] == [True] * len(sources), step
        sources[1].copy_(expected[1])
    others = [torch.randn_like(s) if s.is_floating_point() else s.clone() for s in sources]  # new tensors, same shapes
    ticket = copier.copy_async(others, views, route=route)
    copier.wait(ticket)
    assert all(torch.equal(v, o) for v, o in zip(views, others))
    copier.close()


def test_a_routed_copy_of_the_same_tensors_makes_no_per_tensor_device_work():
    dev = ViewCountingDevice("held", host_resident=lambda t: t.dtype == torch.int64)
    copier = StreamCopier(dev)
    sources, views = _route_case(dev)
    unrouted_before = dev.views_made
    copier.wait(copier.copy_async(sources, views))
    per_unrouted_copy = dev.views_made - unrouted_before
    assert per_unrouted_copy >= 2 * (len(sources) - 1)  # a view per source and per destination, every copy
    route = copier.route(sources, views, keep_sources=True)
    copier.wait(copier.copy_async(sources, views, route=route))  # the first copy along it makes the views
    made, launched = dev.views_made, dev.launches
    for _ in range(3):
        copier.wait(copier.copy_async(sources, views, route=route))
    assert dev.views_made == made  # none after the first
    assert dev.launches - launched == 3 * 2  # per copy: the gather into the scratch and its one DMA
    copier.close()


def test_a_route_takes_the_run_it_was_made_from_at_once_and_checks_any_other_sources():
    """The run a route was made from is taken without comparing its tensors; any other sources are compared
    one by one, and a run holding another tensor is copied from that tensor, not from the route's own."""
    dev = EmulatedDevice("held", host_resident=lambda t: t.dtype == torch.int64)
    copier = StreamCopier(dev)
    sources, views = _route_case(dev)
    run = TensorRun(sources)
    route = copier.route(run, views, keep_sources=True)
    assert route is not None and route.made_from is run
    assert route.kept_sources(run) and route.kept_sources(list(sources))
    other = TensorRun(sources)
    other[0] = sources[0].clone() + 1
    assert not route.kept_sources(other)
    copier.wait(copier.copy_async(other, views, route=route))
    assert torch.equal(views[0], other[0]) and not torch.equal(views[0], sources[0])
    copier.wait(copier.copy_async(run, views, route=route))
    assert all(torch.equal(v, s) for v, s in zip(views, sources))
    copier.close()


# ---- replay's gradients on CUDA's road: one packed clone and one copy per window step ---------------


class StageCountingCopier(StreamCopier):
    """Counts the per-tensor clones (``stage``) and the packed ones (``clone_packed``) of gradients."""

    def __init__(self, device) -> None:
        super().__init__(device)
        self.staged_tensors = 0
        self.packed_clones: list[int] = []  # the tensors in each packed clone

    def stage(self, sources):
        self.staged_tensors += len(sources)
        return super().stage(sources)

    def clone_packed(self, sources, dtype, numel):
        self.packed_clones.append(len(sources))
        return super().clone_packed(sources, dtype, numel)


def _replay_window(tmp_path, make, x, schedule="held"):
    """Checkpoint version 4 (requested after step 1, window 4) over CUDA's placement and clone road."""
    model, opt = make()
    step = _loop(model, opt, x)
    copier = StageCountingCopier(EmulatedDevice(schedule, clone_is_cheap=True, host_resident=torch_cuda_placement(opt)))
    with Checkpointer(model, opt, tmp_path, window=4, consistency="replay", copier=copier) as ckpt:
        step()
        ckpt.request()
        ckpt.step()
        for _ in range(3):
            step()
            ckpt.step()
        (info,) = ckpt.wait(timeout_s=120)
    assert info.step == 4
    return copier


def _twin_after(make, x, steps):
    model, opt = make()
    step = _loop(model, opt, x)
    for _ in range(steps):
        step()
    return _state(model, opt)


def _many_small_layers():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(12)])  # 24 parameters: thousands on a MoE rank
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)


def test_replay_clones_a_window_steps_gradients_in_one_packed_clone_whatever_their_count(tmp_path):
    # On CUDA replay clones each window step's gradients on the compute stream. Cloned one
    # by one (a view, a residency check and a detach each, in Python), 5,625 gradients cost
    # 28 ms per step on average and 325 ms at worst (benchmarks/hook_scaling.py, 30,000
    # state tensors). Now one packed clone per step, drained into the gradient buffer in one copy.
    x = torch.randn(16, 4)
    copier = _replay_window(tmp_path, _many_small_layers, x)
    params = 24
    groups_logged = [1, 2, 3]  # steps 2, 3, 4 consume the groups copied after steps 1, 1-2, 1-3
    assert len(copier.packed_clones) == len(groups_logged)
    assert copier.packed_clones[-1] < params and sorted(copier.packed_clones) == copier.packed_clones
    assert copier.staged_tensors == 0  # no gradient cloned one by one
    assert _differences(_restored(tmp_path, _many_small_layers), _twin_after(_many_small_layers, x, 4)) == []


class _TwoDtypes(nn.Module):
    """fp32 and bf16 parameters in one optimizer: a window step's gradients are not one run of one dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4, dtype=torch.float32 if k % 2 == 0 else torch.bfloat16) for k in range(6)])
        self.in_features = 4

    def __getitem__(self, k):
        return self if k == 0 else self.layers[k]

    def forward(self, x):
        return sum(layer(x.to(layer.weight.dtype)).float() for layer in self.layers)


def _two_dtypes():
    torch.manual_seed(0)
    model = _TwoDtypes()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)


def test_replay_of_gradients_of_two_dtypes_clones_them_one_by_one_and_stays_exact(tmp_path):
    x = torch.randn(16, 4)
    copier = _replay_window(tmp_path, _two_dtypes, x)
    assert copier.staged_tensors > 0  # a step whose gradients hold both dtypes took the per-tensor clones
    assert _differences(_restored(tmp_path, _two_dtypes), _twin_after(_two_dtypes, x, 4)) == []
