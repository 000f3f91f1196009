"""The engine's parts on the CPU: allocation off the hooks, no-sync boundary capture, packed copies, warnings."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from overlapckpt import load
from overlapckpt.hostbuf import SharedHostBuffer
from overlapckpt.seams import Checkpointer, engine_of
from overlapckpt.train.consistency.boundary import capture_boundary, resolve_values
from overlapckpt.train.copying import slots as slots_module
from overlapckpt.train.copying.emulated_device import EmulatedDevice
from overlapckpt.train.copying.layout import build_layout
from overlapckpt.train.copying.packed_copy import SMALL_COPY_BYTES, plan_packed_copy
from overlapckpt.train.copying.stream_copier import StreamCopier

from helpers import assert_state_equal, make_run, snapshot, train_step


class ThreadRecordingBuffer(SharedHostBuffer):
    """Records the thread that allocated each host buffer."""

    threads: list[str] = []

    def __init__(self, nbytes: int, pin: bool) -> None:
        ThreadRecordingBuffer.threads.append(threading.current_thread().name)
        super().__init__(nbytes, pin)


@pytest.mark.parametrize("warm_start", [False, True])
def test_host_buffers_are_allocated_off_the_hooks(tmp_path, monkeypatch, warm_start):
    monkeypatch.setattr(slots_module, "SharedHostBuffer", ThreadRecordingBuffer)
    ThreadRecordingBuffer.threads = []
    model, opt, sched, sampler = make_run()
    if warm_start:
        train_step(model, opt, sched, sampler)  # the optimizer has state before the Checkpointer exists
    with Checkpointer(model, opt, tmp_path, window=4, consistency="replay", max_inflight=2) as ckpt:
        if warm_start:
            assert engine_of(ckpt).parts.slots.prepared_sizes is not None  # started at construction
        for it in range(1, 12):
            train_step(model, opt, sched, sampler)
            if it in (3, 4):
                ckpt.request()
            ckpt.step()
        infos = ckpt.wait(timeout_s=120)
    assert len(infos) == 2
    # Two slots and their gradient buffers (sized for W=4), each on the background thread.
    assert ThreadRecordingBuffer.threads == ["overlapckpt-preallocate"] * 4


def test_grad_scaler_is_captured_without_state_dict_and_equals_it():
    model, opt, _, sampler = make_run(fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2)
    for _ in range(5):
        x, y = sampler.next_batch()
        opt.zero_grad()
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        scaler.step(opt)
        scaler.update()
    expected = scaler.state_dict()
    assert expected["scale"] != 1024.0  # precondition: the scale moved, so the live tensor is read

    class NoStateDict(torch.amp.GradScaler):
        def state_dict(self):  # the synchronizing call must not be used
            raise AssertionError("GradScaler.state_dict() was called")

    scaler.__class__ = NoStateDict
    copier = StreamCopier(EmulatedDevice())
    boundary, tickets = capture_boundary(build_layout(model, opt), opt, {"scaler": scaler}, copier)
    for t in tickets:
        copier.wait(t)
    assert resolve_values(boundary.stateful["scaler"]) == expected
    copier.close()


def _tensor_lr_run():
    model, opt, sched, sampler = make_run(optimizer="adam", foreach=False)
    for g in opt.param_groups:
        g["lr"] = torch.tensor(1e-2)  # a tensor lr: captured through the copier, never .item()
    return model, opt, sched, sampler


def test_a_tensor_learning_rate_replays_exactly(tmp_path):
    model, opt, sched, sampler = _tensor_lr_run()
    twin = {}
    for it in range(1, 9):
        train_step(model, opt, sched, sampler)
        twin[it] = snapshot(model, opt)
    model, opt, sched, sampler = _tensor_lr_run()
    with Checkpointer(model, opt, tmp_path, window=3, consistency="replay", copier=StreamCopier(EmulatedDevice())) as ckpt:
        for it in range(1, 9):
            train_step(model, opt, sched, sampler)
            if it == 3:
                ckpt.request()
            ckpt.step()
        (info,) = ckpt.wait(timeout_s=120)
    assert info.step == 5
    fresh, fresh_opt, _, _ = _tensor_lr_run()
    assert not torch.equal(fresh.inp.weight, twin[5][0]["inp.weight"])
    load(str(tmp_path), fresh, fresh_opt)
    model_sd, _ = twin[5]
    for k, v in model_sd.items():
        assert torch.equal(fresh.state_dict()[k], v), k
    for p_live, p_twin in zip(fresh_opt.state_dict()["state"].values(), twin[5][1]["state"].values()):
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(p_live[k], p_twin[k]), k


def test_small_copies_into_one_slot_are_packed_into_one_span():
    slot = torch.zeros(4096, dtype=torch.uint8)
    big = torch.randn(2 * SMALL_COPY_BYTES // 4)
    small = [torch.tensor(float(i)) for i in range(5)]
    dests = [slot[i * 64 : i * 64 + 4].view(torch.float32).view(()) for i in range(5)]
    packed, rest = plan_packed_copy(small + [big], dests + [torch.empty_like(big)])
    assert packed is not None and rest == [5]
    assert packed.span.numel() == 4 * 64 + 4 and packed.scratch_offsets == (0, 64, 128, 192, 256)
    # Destinations scattered over a large buffer are not worth a span: copied one by one.
    far = [slot[i * 1024 : i * 1024 + 4].view(torch.float32).view(()) for i in range(3)]
    packed, rest = plan_packed_copy(small[:3], far)
    assert packed is None and rest == [0, 1, 2]


def test_a_post_hook_registered_after_the_checkpointer_is_named(tmp_path):
    model, opt, sched, sampler = make_run()
    with Checkpointer(model, opt, tmp_path) as ckpt:
        opt.register_step_post_hook(lambda *args: None)  # an EMA update would go here
        train_step(model, opt, sched, sampler)
        with pytest.warns(UserWarning, match=r"1 optimizer post-step hook\(s\) run after overlapckpt's"):
            ckpt.request()
        ckpt.wait(timeout_s=120)


def test_grad_scaler_first_seen_inside_an_open_replay_window_restarts_it(tmp_path):
    from helpers import scaled_train_step

    def run(ckpt_factory=None):
        model, opt, sched, sampler = make_run(fused=True)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        ckpt = ckpt_factory(model, opt, sched) if ckpt_factory else None
        states = {}
        for it in range(1, 9):
            if it <= 4:
                train_step(model, opt, sched, sampler)  # no GradScaler yet
            else:
                scaled_train_step(model, opt, sched, sampler, scaler)
            states[it] = snapshot(model, opt)
            if ckpt is not None:
                if it == 3:
                    ckpt.request()
                ckpt.step()
        return states, ckpt

    twin, _ = run()
    with pytest.warns(UserWarning, match=r"a replay window open now restarts at window 1"):
        _, ckpt = run(lambda m, o, s: Checkpointer(m, o, tmp_path, window=4, consistency="replay", stateful={"sched": s}))
    try:
        (info,) = ckpt.wait(timeout_s=120)
    finally:
        ckpt.close()
    stats = ckpt.stats[0]
    # Opened at step 3, GradScaler first drove the step-5 update: restarted there at window 1.
    assert (info.step, info.window, stats["ledger"]["restarted_from"], stats["requested_step"]) == (5, 1, 3, 3)
    fresh, fresh_opt, _, _ = make_run(seed=7, fused=True)
    load(str(tmp_path), fresh, fresh_opt)
    assert_state_equal(*twin[5], fresh, fresh_opt)


class SlowEnqueueCopier(StreamCopier):
    """Each enqueue holds the host for ENQUEUE_HOLD_S (busy, like per-tensor work): time the counter must include."""

    ENQUEUE_HOLD_S = 0.02

    def __init__(self) -> None:
        super().__init__(EmulatedDevice())
        self.enqueue_s = 0.0
        self.enqueue_cpu_s = 0.0

    def copy_async(self, sources, destinations, keepalive=(), route=None):
        started, started_cpu = time.perf_counter(), time.thread_time()
        try:
            return super().copy_async(sources, destinations, keepalive, route)
        finally:
            while time.perf_counter() - started < self.ENQUEUE_HOLD_S:
                pass
            self.enqueue_s += time.perf_counter() - started
            self.enqueue_cpu_s += time.thread_time() - started_cpu


@pytest.mark.parametrize("consistency", ["replay", "stage"])
def test_hook_host_time_counts_every_enqueue_made_in_a_hook(tmp_path, consistency):
    model, opt, sched, sampler = make_run()
    copier = SlowEnqueueCopier()
    with Checkpointer(model, opt, tmp_path, window=3, consistency=consistency, copier=copier) as ckpt:
        assert ckpt.hook_host_s == 0.0 and ckpt.hook_cpu_s == 0.0  # nothing ran yet
        train_step(model, opt, sched, sampler)
        ckpt.step()
        ckpt.request()
        for _ in range(4):
            # Per step: every enqueue this step made (pre-hook, post-hook, step()) is in the counter's growth.
            counted_before, enqueued_before = ckpt.hook_host_s, copier.enqueue_s
            cpu_before, enqueued_cpu_before = ckpt.hook_cpu_s, copier.enqueue_cpu_s
            train_step(model, opt, sched, sampler)
            ckpt.step()
            assert ckpt.hook_host_s - counted_before >= copier.enqueue_s - enqueued_before
            # The same for the thread's CPU time, which the enqueues' busy hold spends on this thread.
            assert ckpt.hook_cpu_s - cpu_before >= copier.enqueue_cpu_s - enqueued_cpu_before
        ckpt.wait()
        assert copier.enqueue_s >= 3 * SlowEnqueueCopier.ENQUEUE_HOLD_S  # the window's copies ran through it
        assert ckpt.hook_cpu_s >= copier.enqueue_cpu_s > 0
