"""The engine in the loops people train with: closures, wrapped optimizers, skipped updates, other pre-hooks.

Each scenario runs an uninterrupted twin, then the same loop with a Checkpointer,
and compares every committed checkpoint with the twin at its version, bit for
bit. The copier is the adversarial CPU stream (a copy runs only when waited for),
so a fence in the wrong place tears the snapshot on every run.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from overlapckpt import ConfigError, load
from overlapckpt.seams import Checkpointer
from overlapckpt.train.copying.emulated_device import EmulatedDevice
from overlapckpt.train.copying.stream_copier import StreamCopier
from overlapckpt.train.copying.transfer import CopyTicket, FenceResult

from helpers import closure_train_step, make_run, snapshot, tensors_that_differ, train_step, twin_states

REQUEST_AT = 3


class HeldCopier(StreamCopier):
    """A copy runs when waited for, no earlier: the latest a real stream could run it."""

    def __init__(self, events: list[str] | None = None) -> None:
        super().__init__(EmulatedDevice("held"))
        self.events = events

    def fence_compute(self, ticket: CopyTicket) -> FenceResult:
        result = super().fence_compute(ticket)
        if self.events is not None and ticket.group_index == 0 and result != FenceResult.NOT_NEEDED:
            self.events.append("fence")
        return result


def _judge(tmp_path, infos, twin, prepare=None, **run_kwargs) -> dict[int, list[str]]:
    """Per committed version: the tensors that differ from the twin at that version.

    ``prepare(model, opt, expected)`` shapes the fresh optimizer like the run's (DCP loads into
    the state the target has, so state created lazily must exist there first).
    """
    out = {}
    for info in infos:
        model, opt, _, _ = make_run(seed=42, **run_kwargs)
        if prepare is not None:
            prepare(model, opt, twin[info.step])
        load(str(tmp_path), model, opt, step=info.step)
        out[info.step] = tensors_that_differ(twin[info.step], model, opt)
    return out


MODES = [dict(window=1), dict(window=3, consistency="replay"), dict(window=3, consistency="stage")]


@pytest.mark.parametrize("settings", MODES, ids=["window-1", "replay-3", "stage-3"])
def test_closure_loop_is_bit_exact(tmp_path, settings):
    steps = REQUEST_AT + 5
    twin = twin_states(steps, closure_train_step)
    model, opt, sched, sampler = make_run()
    with Checkpointer(model, opt, tmp_path, stateful={"sched": sched}, copier=HeldCopier(), **settings) as ckpt:
        for it in range(1, steps + 1):
            closure_train_step(model, opt, sched, sampler)
            if it == REQUEST_AT:
                ckpt.request()
            ckpt.step()
        infos = ckpt.wait(timeout_s=120)
    expected = REQUEST_AT + 2 if settings.get("consistency") == "replay" else REQUEST_AT
    assert [i.step for i in infos] == [expected]
    # The precondition: the state moved on after the request, so a stale gradient or copy would show.
    assert not torch.equal(twin[REQUEST_AT][0]["inp.weight"], twin[steps][0]["inp.weight"])
    assert _judge(tmp_path, infos, twin) == {expected: []}


def test_closure_step_fences_after_forward_and_backward(tmp_path):
    """Window 1 with a closure: the copy started after step 3 is waited for after step 4's backward, not before it."""
    events: list[str] = []
    model, opt, sched, sampler = make_run()
    model.register_forward_hook(lambda *_: events.append("forward"))
    with Checkpointer(model, opt, tmp_path, window=1, copier=HeldCopier(events)) as ckpt:
        for it in range(1, 5):
            if it == REQUEST_AT + 1:
                events.clear()
            closure_train_step(model, opt, sched, sampler)
            if it == REQUEST_AT:
                ckpt.request()
            ckpt.step()
        ckpt.wait(timeout_s=60)
    assert events[:2] == ["forward", "fence"], events


def _accelerate_run(tmp_path, steps: int, accumulation: int, settings: dict | None):
    """A plain Accelerate loop; with ``settings``, a Checkpointer on the prepared optimizer."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulation)
    model, opt, sched, sampler = make_run()
    model, opt = accelerator.prepare(model, opt)
    assert type(opt).__name__ == "AcceleratedOptimizer"
    ckpt = None
    if settings is not None:
        ckpt = Checkpointer(model, opt, tmp_path, stateful={"sched": sched}, copier=HeldCopier(), **settings)
    states, updates = {}, 0
    for _ in range(steps * accumulation):
        x, y = sampler.next_batch(32 // accumulation)
        with accelerator.accumulate(model):
            loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
        if accelerator.sync_gradients:
            sched.step()
            updates += 1
            states[updates] = snapshot(model, opt.optimizer)
            if ckpt is not None and updates == REQUEST_AT:
                ckpt.request()
        if ckpt is not None:
            ckpt.step()
    infos = []
    if ckpt is not None:
        infos = ckpt.close(timeout_s=120)
        assert ckpt.step_count == steps  # micro-batches are not steps
    return states, infos


@pytest.mark.parametrize("accumulation", [1, 2], ids=["no-accumulation", "accumulate-2"])
@pytest.mark.parametrize("settings", MODES[:2], ids=["window-1", "replay-3"])
def test_accelerate_prepared_optimizer_is_bit_exact(tmp_path, settings, accumulation):
    steps = REQUEST_AT + 4
    twin, _ = _accelerate_run(tmp_path / "twin", steps, accumulation, None)
    _, infos = _accelerate_run(tmp_path, steps, accumulation, settings)
    expected = REQUEST_AT + 2 if settings.get("consistency") == "replay" else REQUEST_AT
    assert [i.step for i in infos] == [expected]
    assert _judge(tmp_path, infos, twin) == {expected: []}


def test_skipped_update_does_not_advance_the_version(tmp_path):
    """GradScaler skips an update with infinite gradients: no hook fires, and every= counts real updates."""
    poisoned = 3  # this iteration's gradients are infinite

    def run(ckpt_settings):
        model, opt, sched, sampler = make_run()
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1000)
        ckpt = Checkpointer(model, opt, tmp_path, copier=HeldCopier(), **ckpt_settings) if ckpt_settings else None
        states, updates = {}, 0
        for it in range(1, 8):
            x, y = sampler.next_batch()
            loss = nn.functional.mse_loss(model(x), y) * (float("inf") if it == poisoned else 1.0)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            before = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            if scaler.get_scale() == before:  # not skipped
                updates += 1
                states[updates] = snapshot(model, opt)
            if ckpt is not None:
                ckpt.step()
        infos = ckpt.close(timeout_s=120) if ckpt is not None else []
        return states, infos, None if ckpt is None else ckpt.step_count

    twin, _, _ = run(None)
    assert len(twin) == 6  # the precondition: one of the 7 updates was skipped
    _, infos, step_count = run(dict(window=1, every=2, max_inflight=3))  # never merged: one slot each
    assert step_count == 6
    assert [i.step for i in infos] == [2, 4, 6]
    assert _judge(tmp_path, infos, twin) == {2: [], 4: [], 6: []}


def _with_earlier_pre_hook(tmp_path, hook_factory, settings, step_fn=train_step, steps=REQUEST_AT + 5):
    """Twin and checkpointed runs with a step pre-hook registered *before* the Checkpointer."""

    def run(checkpoint: bool):
        model, opt, sched, sampler = make_run()
        opt.register_step_pre_hook(hook_factory(model, opt))
        ckpt = Checkpointer(model, opt, tmp_path, copier=HeldCopier(), **settings) if checkpoint else None
        states = {}
        for it in range(1, steps + 1):
            step_fn(model, opt, sched, sampler)
            states[it] = snapshot(model, opt)
            if ckpt is not None:
                if it == REQUEST_AT:
                    ckpt.request()
                ckpt.step()
        return states, (ckpt.close(timeout_s=120) if ckpt is not None else [])

    twin, _ = run(False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, infos = run(True)
    return twin, infos, [str(w.message) for w in caught]


def _projection_hook(model, opt):
    """Writes a parameter and a buffer in place before every update (a weight projection, MoE bias balancing)."""

    def project_weights(optimizer, args, kwargs):
        with torch.no_grad():
            model.inp.weight.mul_(0.999)
            model.norm.running_mean.mul_(0.5)

    return project_weights


@pytest.mark.parametrize("step_fn", [train_step, closure_train_step], ids=["plain", "closure"])
def test_earlier_pre_hook_that_mutates_state_keeps_window_1_exact(tmp_path, step_fn):
    twin, infos, _ = _with_earlier_pre_hook(tmp_path, _projection_hook, dict(window=1), step_fn=step_fn)
    assert [i.step for i in infos] == [REQUEST_AT]
    assert _judge(tmp_path, infos, twin) == {REQUEST_AT: []}


def test_earlier_pre_hook_that_mutates_state_is_named_and_replay_falls_back(tmp_path):
    twin, infos, messages = _with_earlier_pre_hook(tmp_path, _projection_hook, dict(window=3, consistency="replay"))
    named = [m for m in messages if "written in place before the optimizer's update" in m]
    assert named and "project_weights" in named[0]
    # The window restarted at window 1, at the step the write was seen: exact there.
    assert [i.step for i in infos] == [REQUEST_AT + 1]
    assert _judge(tmp_path, infos, twin) == {REQUEST_AT + 1: []}


def _lazy_state_hook(model, opt):
    """Creates optimizer state lazily, before the update of step REQUEST_AT + 2 (TorchTitan's style of init)."""
    calls = {"n": 0}

    def create_state_lazily(optimizer, args, kwargs):
        calls["n"] += 1
        if calls["n"] == REQUEST_AT + 2:
            opt.state[model.out.bias]["created_lazily"] = torch.full_like(model.out.bias, 7.0)

    return create_state_lazily


@pytest.mark.parametrize("settings", MODES[:2], ids=["window-1", "replay-3"])
def test_earlier_pre_hook_that_creates_state_lazily(tmp_path, settings):
    twin, infos, messages = _with_earlier_pre_hook(tmp_path, _lazy_state_hook, settings)
    if settings["window"] == 1:
        assert [i.step for i in infos] == [REQUEST_AT]
    else:
        # The window lacks the new state: it is restarted, and the restart is named.
        assert any("gained state" in m for m in messages)
        assert [i.step for i in infos] == [REQUEST_AT + 2 + 2]

    def create_like_the_run(model, opt, expected):
        from torch.distributed.checkpoint.state_dict import _init_optim_state

        _init_optim_state(opt)
        if any("created_lazily" in st for st in expected[1]["state"].values()):
            opt.state[model.out.bias]["created_lazily"] = torch.zeros_like(model.out.bias)

    assert _judge(tmp_path, infos, twin, prepare=create_like_the_run) == {infos[0].step: []}


def test_lightning_optimizer_is_unwrapped(tmp_path):
    from pytorch_lightning.core.optimizer import LightningOptimizer

    model, opt, sched, sampler = make_run()
    wrapped = LightningOptimizer(opt)
    with Checkpointer(model, wrapped, tmp_path, window=3, consistency="replay") as ckpt:
        assert ckpt.optimizer is opt
        for _ in range(4):
            train_step(model, opt, sched, sampler)
            ckpt.step()
        ckpt.request()


class NeverInitialized(torch.optim.Optimizer):
    """An Optimizer subclass that skips Optimizer.__init__: its step fires no hooks."""

    def __init__(self, params) -> None:
        self.param_groups = [{"params": list(params)}]

    def step(self, closure=None):
        return None


class OpaqueStepper:
    def step(self) -> None:
        return None


@pytest.mark.parametrize("make", [lambda m: NeverInitialized(m.parameters()), lambda m: OpaqueStepper()], ids=["no-hooks", "opaque"])
def test_a_wrapper_that_cannot_be_hooked_is_refused_by_name(tmp_path, make):
    model = make_run()[0]
    bad = make(model)
    with pytest.raises(ConfigError, match=type(bad).__qualname__) as info:
        Checkpointer(model, bad, tmp_path)
    assert "Pass the torch.optim.Optimizer that it steps" in str(info.value)
