"""Windows over 1: replay (version s+W-1) and stage (version s) give the exact state at V."""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch

from overlapckpt import Checkpointer, ConfigError, load
from overlapckpt.errors import UnsupportedOptimizerError
from overlapckpt.seams import engine_of
from overlapckpt.train.copying.slots import AUTO_SECOND_SLOT_MAX_BYTES, auto_slot_count

from fakes import ONLY_NAME_ENV, WRITE_GATE_ENV, GatedWriteStore
from helpers import assert_state_equal, make_run, scaled_train_step, snapshot, train_step

REQUEST_AT = 3


def _twin(optimizer: str, iterations: int, skip_at: int | None, **opt_kwargs) -> dict[int, tuple[dict, dict]]:
    """States of an uninterrupted run, by optimizer step (a skipped iteration takes no step)."""
    model, opt, sched, sampler = make_run(optimizer=optimizer, **opt_kwargs)
    states, steps = {}, 0
    for it in range(1, iterations + 1):
        train_step(model, opt, sched, sampler, skip=(it == skip_at))
        steps += it != skip_at
        states.setdefault(steps, snapshot(model, opt))  # a skipped iteration keeps the version
    return states


def _checkpointed(tmp_path, optimizer, iterations, skip_at, window, consistency, close_at=None, **opt_kwargs):
    model, opt, sched, sampler = make_run(optimizer=optimizer, **opt_kwargs)
    ckpt = Checkpointer(model, opt, tmp_path, window=window, consistency=consistency, stateful={"sched": sched})
    try:
        for it in range(1, iterations + 1):
            train_step(model, opt, sched, sampler, skip=(it == skip_at))
            if it == REQUEST_AT:
                ckpt.request()
            ckpt.step()
            if close_at is not None and it == close_at:
                break
        infos = ckpt.close(timeout_s=120)
    finally:
        ckpt.close(timeout_s=30)
    return infos, ckpt


IMPLEMENTATIONS = {
    "sgd": [{"foreach": True}, {"fused": True}],
    "adam": [{"foreach": True}, {"fused": True}],
    "adamw": [{"foreach": True, "amsgrad": True}, {"fused": True, "amsgrad": True}],
}
# Replay runs the optimizer's own update rule on the CPU, so every implementation is a
# case (a narrow and a wide window). Stage only clones and drains, whatever the update
# rule: one implementation per optimizer, and one wide window.
CASES = [
    (opt, kw, window, "replay") for opt, kws in IMPLEMENTATIONS.items() for kw in kws for window in (3, 8)
] + [(opt, kws[0], 3, "stage") for opt, kws in IMPLEMENTATIONS.items()] + [("adamw", IMPLEMENTATIONS["adamw"][1], 8, "stage")]


@pytest.mark.parametrize("optimizer, opt_kwargs, window, consistency", CASES, ids=lambda v: str(v).replace(" ", ""))
def test_snapshot_equals_twin_at_version(tmp_path, optimizer, opt_kwargs, window, consistency, cpu_device):
    skip_at = REQUEST_AT + 2  # one iteration inside the window takes no optimizer step
    iterations = REQUEST_AT + window + 3
    twin = _twin(optimizer, iterations, skip_at, **opt_kwargs)
    infos, _ = _checkpointed(tmp_path, optimizer, iterations, skip_at, window, consistency, **opt_kwargs)
    expected = REQUEST_AT if consistency == "stage" else REQUEST_AT + window - 1
    assert [i.step for i in infos] == [expected]
    model, opt, _, _ = make_run(seed=42, optimizer=optimizer, **opt_kwargs)
    assert twin[expected][0]["inp.weight"].ne(twin[REQUEST_AT][0]["inp.weight"]).any() or expected == REQUEST_AT
    load(str(tmp_path), model, opt)
    assert_state_equal(*twin[expected], model, opt)


def test_ledger_in_manifest_matches_the_driven_steps(tmp_path):
    window = 4
    infos, ckpt = _checkpointed(tmp_path, "adamw", 10, None, window, "replay")
    manifest = json.loads((tmp_path / "step-000000006" / "overlapckpt.json").read_text())
    ledger = manifest["ledger"]
    assert ledger["requested_step"] == REQUEST_AT and ledger["target_version"] == 6
    assert [g["version"] for g in ledger["groups"]] == [3, 4, 5, 6]
    assert ledger["gradient_steps"] == {"4": [0], "5": [0, 1], "6": [0, 1, 2]}
    assert ledger["hyperparameter_steps"] == [4, 5, 6]
    assert all(g["landed_s"] is not None for g in ledger["groups"])
    assert ckpt.stats[0]["ledger"]["groups"] == ledger["groups"]


def test_close_early_commits_at_the_current_step(tmp_path):
    close_at = REQUEST_AT + 3
    twin = _twin("adam", close_at, None)
    infos, _ = _checkpointed(tmp_path, "adam", 20, None, 8, "replay", close_at=close_at)
    assert [i.step for i in infos] == [close_at]
    manifest = json.loads((tmp_path / f"step-{close_at:09d}" / "overlapckpt.json").read_text())
    assert manifest["ledger"]["closed_early_at"] == close_at
    model, opt, _, _ = make_run(seed=42, optimizer="adam")
    load(str(tmp_path), model, opt)
    assert_state_equal(*twin[close_at], model, opt)


@pytest.mark.parametrize("max_inflight, deferrals", [(1, 1), (2, 0)])
def test_request_during_open_window_is_deferred_not_dropped(tmp_path, max_inflight, deferrals):
    twin = _twin("adamw", 12, None)
    model, opt, sched, sampler = make_run(optimizer="adamw")
    with Checkpointer(model, opt, tmp_path, window=3, max_inflight=max_inflight) as ckpt:
        for it in range(1, 13):
            train_step(model, opt, sched, sampler)
            if it in (REQUEST_AT, REQUEST_AT + 1):
                ckpt.request()
            ckpt.step()
        infos = ckpt.wait(timeout_s=120)
        assert ckpt.deferrals == deferrals
        stats = ckpt.stats
    steps = [i.step for i in infos]
    assert len(steps) == 2 and steps[0] == REQUEST_AT + 2
    if max_inflight == 2:
        assert steps[1] == REQUEST_AT + 3
    else:
        assert steps[1] > REQUEST_AT + 2 and stats[1]["deferred"]
    for step in steps:
        fresh, fresh_opt, _, _ = make_run(seed=9, optimizer="adamw")
        load(str(tmp_path), fresh, fresh_opt, step=step)
        assert_state_equal(*twin[step], fresh, fresh_opt)


def test_stage_budget_too_small_names_the_bytes(tmp_path):
    model, opt, sched, sampler = make_run()
    with Checkpointer(model, opt, tmp_path, window=4, consistency="stage", stage_budget_bytes=64):
        # The first step creates the optimizer state, whose size the budget is checked
        # against then: before any checkpoint is requested.
        with pytest.raises(ConfigError, match=r"stage mode needs \d+ bytes of staging for window 4.*stage_budget_bytes=64"):
            train_step(model, opt, sched, sampler)
    # With the state already there, the same settings are refused at construction.
    with pytest.raises(ConfigError, match=r"stage_budget_bytes=64; raise stage_budget_bytes to at least \d+"):
        Checkpointer(model, opt, tmp_path, window=4, consistency="stage", stage_budget_bytes=64)


def test_custom_non_elementwise_optimizer_is_refused_for_replay(tmp_path):
    class Shampoo(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {"lr": 0.1})

        def step(self, closure=None):
            return None

    model, _, _, _ = make_run()
    with pytest.raises(UnsupportedOptimizerError, match=r"Shampoo cannot be replayed"):
        Checkpointer(model, Shampoo(model.parameters()), tmp_path, window=2)
    # Stage mode and window 1 take any optimizer.
    Checkpointer(model, Shampoo(model.parameters()), tmp_path, window=2, consistency="stage").close()


def test_state_created_inside_a_replay_window_restarts_it(tmp_path):
    # A layer unfrozen at step 5 gets AdamW state at that step; a replay window opened at
    # step 3 has no room for it, so it is restarted at step 5 and holds it at version 8.
    def run():
        model, opt, sched, sampler = make_run()
        model.out.weight.requires_grad_(False)
        states = {}
        for it in range(1, 11):
            if it == 5:
                model.out.weight.requires_grad_(True)
            train_step(model, opt, sched, sampler)
            states[it] = snapshot(model, opt)
        return states

    twin = run()
    model, opt, sched, sampler = make_run()
    assert len(twin[4][1]["state"]) < len(twin[5][1]["state"])  # precondition: step 5 created state
    with pytest.warns(UserWarning, match=r"gained state .* requested at step 3 .* restarted at step 5"):
        with Checkpointer(model, opt, tmp_path, window=4, consistency="replay") as ckpt:
            model.out.weight.requires_grad_(False)
            for it in range(1, 11):
                if it == 5:
                    model.out.weight.requires_grad_(True)
                train_step(model, opt, sched, sampler)
                if it == REQUEST_AT:
                    ckpt.request()
                ckpt.step()
            (info,) = ckpt.wait(timeout_s=120)
    assert ckpt.stats[0]["ledger"]["restarted_from"] == REQUEST_AT
    # The request's own step is kept; the ledger shows where the restarted copies began.
    assert (ckpt.stats[0]["requested_step"], ckpt.stats[0]["ledger"]["started_step"], info.step) == (3, 5, 8)
    fresh, fresh_opt, _, _ = make_run(seed=7)
    fresh.out.weight.requires_grad_(True)
    load(str(tmp_path), fresh, fresh_opt)
    assert_state_equal(*twin[8], fresh, fresh_opt)


def test_reading_state_of_a_frozen_parameter_does_not_restart_the_window(tmp_path, recwarn):
    # optimizer.state is a defaultdict: a read adds an empty entry, which is not state.
    model, opt, sched, sampler = make_run()
    model.out.weight.requires_grad_(False)
    with Checkpointer(model, opt, tmp_path, window=4, consistency="replay") as ckpt:
        for it in range(1, 9):
            train_step(model, opt, sched, sampler)
            if it == REQUEST_AT:
                ckpt.request()
            if it == 4:
                assert opt.state[model.out.weight] == {}  # precondition: the read creates the entry
            ckpt.step()
        (info,) = ckpt.wait(timeout_s=120)
    assert info.step == REQUEST_AT + 3 and ckpt.stats[0]["ledger"]["restarted_from"] is None
    assert not [w for w in recwarn if "gained state" in str(w.message)]


def test_grad_scaler_with_a_fused_optimizer_falls_back_to_window_1(tmp_path):
    twin_model, twin_opt, twin_sched, twin_sampler = make_run(fused=True)
    twin_scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    twin = {}
    for it in range(1, 8):
        scaled_train_step(twin_model, twin_opt, twin_sched, twin_sampler, twin_scaler)
        twin[it] = snapshot(twin_model, twin_opt)
    model, opt, sched, sampler = make_run(fused=True)  # seeds again: the same dropout masks as the twin
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    with pytest.warns(UserWarning, match=r"GradScaler drives this optimizer's fused step.*use window=1 instead"):
        with Checkpointer(model, opt, tmp_path, window=4, consistency="replay", stateful={"sched": sched}) as ckpt:
            for it in range(1, 8):
                scaled_train_step(model, opt, sched, sampler, scaler)
                if it == REQUEST_AT:
                    ckpt.request()
                ckpt.step()
            (info,) = ckpt.wait(timeout_s=120)
    assert (info.step, info.window, info.mode) == (REQUEST_AT, 1, "single")
    fresh, fresh_opt, _, _ = make_run(seed=7, fused=True)
    load(str(tmp_path), fresh, fresh_opt)
    assert_state_equal(*twin[REQUEST_AT], fresh, fresh_opt)


@pytest.mark.parametrize(
    "optimizer, expected",
    [
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True), True),  # foreach by default on CUDA
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, foreach=False), False),
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), False),
        (lambda p: torch.optim.AdamW(p, lr=0.1, foreach=True), False),
    ],
)
def test_optimizers_that_write_gradients_in_their_step_are_known(optimizer, expected):
    # SGD's foreach Nesterov path adds the momentum into .grad in place (torch/optim/sgd.py):
    # its gradient copy must be fenced before the step, not after.
    from overlapckpt.train.consistency.gradlog import step_writes_gradients as _step_writes_gradients

    model, _, _, _ = make_run()
    assert _step_writes_gradients(optimizer(model.parameters())) is expected


def _run_with_a_parameter_left_out(seed: int = 0):
    """TinyNet whose output layer's bias no optimizer owns (it stays at its initial value)."""
    model, _, _, sampler = make_run(seed=seed)
    params = [p for name, p in model.named_parameters() if name != "out.bias"]
    return model, torch.optim.AdamW(params, lr=1e-2, foreach=True), sampler


def _step_left_out(model, opt, sampler):
    x, y = sampler.next_batch()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("window", [1, 3])
def test_a_parameter_no_optimizer_owns_is_carried_unchanged(tmp_path, window):
    # Before, W>1 replay raised a raw KeyError from the gradient layout at the first step.
    model, opt, sampler = _run_with_a_parameter_left_out()
    twin = {}
    for s in range(1, 7):
        _step_left_out(model, opt, sampler)
        twin[s] = snapshot(model, opt)
    assert torch.equal(twin[6][0]["out.bias"], make_run()[0].out.bias.detach())  # the precondition: never updated
    model, opt, sampler = _run_with_a_parameter_left_out()
    with Checkpointer(model, opt, tmp_path, window=window, consistency="replay") as ckpt:
        for s in range(1, 7):
            _step_left_out(model, opt, sampler)
            if s == REQUEST_AT:
                ckpt.request()
            ckpt.step()
        (info,) = ckpt.wait(timeout_s=120)
    assert info.step == REQUEST_AT + window - 1
    fresh, fresh_opt, fresh_sampler = _run_with_a_parameter_left_out(seed=5)
    _step_left_out(fresh, fresh_opt, fresh_sampler)
    load(str(tmp_path), fresh, fresh_opt)
    assert_state_equal(*twin[info.step], fresh, fresh_opt)


def test_replay_accepts_a_tensor_lr_that_training_ran_with_foreach_and_capturable():
    # On CUDA, AdamW(foreach=True, capturable=True) takes a tensor lr. The writer replays on
    # CPU tensors with capturable off, where torch refuses a tensor lr with foreach; it takes
    # the single-tensor path instead, which computes the same update.
    from overlapckpt.writer.replay import replay_hyperparameters

    torch.manual_seed(0)
    start, grad = torch.randn(16), torch.randn(16)
    trained = torch.optim.AdamW([torch.nn.Parameter(start.clone())], lr=torch.tensor(1e-2), foreach=True, capturable=True)
    logged = {k: v for k, v in trained.param_groups[0].items() if k != "params"}
    refused = torch.nn.Parameter(start.clone())
    refused.grad = grad.clone()
    with pytest.raises(RuntimeError, match="lr as a Tensor is not supported"):  # the precondition: capturable off, CPU refuses it
        torch.optim.AdamW([{"params": [refused], **logged, "capturable": False}]).step()
    replayed, reference = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    replay_opt = torch.optim.AdamW([{"params": [replayed], **replay_hyperparameters(logged)}])  # as the writer builds it
    reference_opt = torch.optim.AdamW([reference], lr=torch.tensor(1e-2), foreach=False)
    for p, opt in ((replayed, replay_opt), (reference, reference_opt)):
        for _ in range(3):
            p.grad = grad.clone()
            opt.step()
    assert torch.equal(replayed, reference) and not torch.equal(replayed, start)


@pytest.mark.parametrize(
    ("window", "consistency", "every", "opened_at"),
    [(4, "replay", 5, [2, 7, 12]), (3, "stage", 5, [5, 10, 15]), ("auto", "replay", 5, None), (4, "replay", 3, [1, 4, 7, 10, 13])],
    ids=["replay-4-every-5", "stage-3-every-5", "auto-replay-every-5", "replay-4-every-3"],
)
def test_scheduled_checkpoints_hold_the_steps_asked_for(tmp_path, window, consistency, every, opened_at):
    """every=N is a schedule known in advance: a replay window opens W-1 steps early (at most every-1), so the
    version is the step asked for. Before: every=100 at W=4 gave step-103, and W=3 checkpoints fell mid-epoch."""
    steps = 15
    twin = _twin("adamw", steps, None)
    model, opt, sched, sampler = make_run()
    with Checkpointer(model, opt, tmp_path, window=window, consistency=consistency, every=every, stateful={"sched": sched}) as ckpt:
        for it in range(1, steps + 1):
            train_step(model, opt, sched, sampler)
            ckpt.step()
            if it % every == 0:
                ckpt.wait(timeout_s=120)  # each commits before the next window opens: no deferral decides the test
    versions = list(range(every, steps + 1, every))
    manifests = [json.loads((tmp_path / f"step-{v:09d}" / "overlapckpt.json").read_text()) for v in versions]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step-")) == [f"step-{v:09d}" for v in versions]
    for version, manifest in zip(versions, manifests):
        assert manifest["ledger"]["scheduled_version"] == version and manifest["ledger"]["target_version"] == version
    if opened_at is not None:
        assert [m["ledger"]["started_step"] for m in manifests] == opened_at
    for version in versions:
        fresh, fresh_opt, _, _ = make_run(seed=42)
        load(str(tmp_path), fresh, fresh_opt, step=version)
        assert_state_equal(*twin[version], fresh, fresh_opt)


def _open_gate(fifo: str, timeout_s: float = 120.0) -> None:
    """Write the byte GatedWriteStore's writer waits for; the open blocks until the writer reads, so on a thread, with a timeout."""
    opened = threading.Thread(target=lambda: open(fifo, "wb").write(b"x"), daemon=True)
    opened.start()
    opened.join(timeout_s)
    assert not opened.is_alive(), f"the writer never reached the gate {fifo} within {timeout_s} s"


# With one slot, step 8's window opens at 7 or 8, as step 6's persist has committed by then or not: not compared.
@pytest.mark.parametrize(("max_inflight", "opened_at"), [("auto", [1, 3, 5, 7]), (1, [1, 4, 5])])
def test_a_persist_slower_than_every_does_not_cut_the_next_window_of_a_small_state(tmp_path, monkeypatch, max_inflight, opened_at):
    """max_inflight="auto" (the default) keeps a second host slot for a small state. with every=2 and window=4,
    each replay window opens a step before its version (W=2). Step 2's persist is held (its first write waits for
    the test's gate): step 4's window opens at step 3 in the second slot. Before: one slot, so it waited at step 4
    and was cut to window 1 (started at 4), as max_inflight=1 still does, and on a tiny model with short steps
    every later checkpoint fell back to window 1."""
    gate = str(tmp_path / "gate")
    os.mkfifo(gate)
    monkeypatch.setenv(WRITE_GATE_ENV, gate)
    monkeypatch.setenv(ONLY_NAME_ENV, "step-000000002")
    root = tmp_path / "root"
    steps = 8
    twin = _twin("adamw", steps, None)
    model, opt, sched, sampler = make_run()
    with Checkpointer(
        model, opt, root, window=4, every=2, max_inflight=max_inflight, store_class=GatedWriteStore, stateful={"sched": sched}
    ) as ckpt:
        for it in range(1, steps + 1):
            if it == 4:
                _open_gate(gate)  # step 2's persist was held through step 3's hook
            train_step(model, opt, sched, sampler)
            ckpt.step()
            if it % 4 == 0:
                ckpt.wait(timeout_s=120)  # both slots free again: only the held persist decides the test
        slots = len(engine_of(ckpt).parts.slots.slots)
    assert slots == (2 if max_inflight == "auto" else 1)
    manifests = [json.loads((root / f"step-{v:09d}" / "overlapckpt.json").read_text()) for v in (2, 4, 6, 8)]
    assert [m["ledger"]["started_step"] for m in manifests][: len(opened_at)] == opened_at
    for version in (2, 4, 6, 8):
        fresh, fresh_opt, _, _ = make_run(seed=42)
        load(str(root), fresh, fresh_opt, step=version)
        assert_state_equal(*twin[version], fresh, fresh_opt)


def test_auto_inflight_keeps_a_second_slot_only_for_a_small_state_in_one_process():
    assert auto_slot_count(1 << 20, 1 << 20, distributed=False) == 2
    assert auto_slot_count(AUTO_SECOND_SLOT_MAX_BYTES - 4096, 4096, distributed=False) == 2
    assert auto_slot_count(AUTO_SECOND_SLOT_MAX_BYTES, 1, distributed=False) == 1  # a second copy of a large state: the user's call
    assert auto_slot_count(1 << 20, 0, distributed=True) == 1  # ranks' sizes differ; every rank must start at the same step
