"""A load or restore that fails leaves every live object as it was; one with nothing to restore starts fresh when asked.

Before: ``load()`` into an optimizer built over another model instance raised torch's bare
``KeyError: 0``; ``load()``/``restore()`` on an empty root raised CheckpointNotFoundError
only after creating AdamW's state (step 1, zero moments), so a run that caught the error
and trained on differed from one that never tried; ``restore()`` on a fresh root raised,
so every restartable script wrapped it in its own try/except.
"""

from __future__ import annotations

import pytest
import torch

from overlapckpt import Checkpointer, CheckpointNotFoundError, ConfigError, load

from helpers import make_run, snapshot, train_step


def _twin_after(steps: int) -> tuple[dict, dict]:
    model, opt, sched, sampler = make_run()
    for _ in range(steps):
        train_step(model, opt, sched, sampler)
    return snapshot(model, opt)


def _assert_same(expected: tuple[dict, dict], model, opt) -> None:
    model_sd, opt_sd = expected
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in model_sd.items())
    got = opt.state_dict()
    assert got["param_groups"] == opt_sd["param_groups"] and got["state"].keys() == opt_sd["state"].keys()
    for i, s in opt_sd["state"].items():
        assert all(torch.equal(v, got["state"][i][k]) for k, v in s.items()), i


def test_a_load_that_finds_nothing_creates_no_optimizer_state_and_training_on_equals_the_twin(tmp_path):
    model, opt, sched, sampler = make_run()
    with pytest.raises(CheckpointNotFoundError, match="pass missing_ok=True to start fresh"):
        load(str(tmp_path), model, opt)
    assert opt.state_dict()["state"] == {}  # before: AdamW's state at step 1, made by get_state_dict
    assert load(str(tmp_path), model, opt, missing_ok=True) is None
    assert opt.state_dict()["state"] == {}
    for _ in range(3):
        train_step(model, opt, sched, sampler)
    _assert_same(_twin_after(3), model, opt)


def test_restore_missing_ok_starts_fresh_and_restore_alone_names_the_fix(tmp_path):
    model, opt, sched, sampler = make_run()
    with Checkpointer(model, opt, tmp_path, every=2, stateful={"sched": sched, "sampler": sampler}) as ckpt:
        with pytest.raises(CheckpointNotFoundError, match="missing_ok=True"):
            ckpt.restore()
        assert ckpt.restore(missing_ok=True) is None  # a first run: nothing touched
        assert ckpt.step_count == 0 and opt.state_dict()["state"] == {}
        for _ in range(3):
            train_step(model, opt, sched, sampler)
            ckpt.step()
    _assert_same(_twin_after(3), model, opt)
    # The restart: the same line resumes the newest checkpoint.
    model, opt, sched, sampler = make_run(seed=5)
    with Checkpointer(model, opt, tmp_path, every=2, stateful={"sched": sched, "sampler": sampler}) as ckpt:
        info = ckpt.restore(missing_ok=True)
        assert info is not None and info.step == 2 and ckpt.step_count == 2
        train_step(model, opt, sched, sampler)
        ckpt.step()
    _assert_same(_twin_after(3), model, opt)


def test_an_optimizer_over_another_model_instance_is_refused_by_name_before_anything_changes(tmp_path):
    model, opt, sched, sampler = make_run()
    with Checkpointer(model, opt, tmp_path, every=1) as ckpt:
        train_step(model, opt, sched, sampler)
        ckpt.step()
    fresh, _, _, _ = make_run(seed=3)
    _, other_opt, _, _ = make_run(seed=4)  # built over another instance of the same model
    before = snapshot(fresh, other_opt)
    with pytest.raises(ConfigError, match=r"optimizer.param_groups\[0\]\['params'\]\[0\] .* is not a parameter of the model passed to load"):
        load(str(tmp_path), fresh, other_opt)  # before: KeyError: 0 from torch's set_state_dict
    _assert_same(before, fresh, other_opt)


class _RefusingSampler:
    """A stateful object whose load_state_dict fails on purpose, after the scheduler before it was loaded."""

    def state_dict(self):
        return {"position": 0}

    def load_state_dict(self, state):
        raise RuntimeError("this sampler refuses its state")


def test_a_stateful_object_that_fails_to_load_puts_back_the_ones_loaded_before_it_and_the_tensors_are_untouched(tmp_path):
    model, opt, sched, sampler = make_run()
    with Checkpointer(model, opt, tmp_path, every=2, stateful={"a_sched": sched, "b_sampler": sampler}) as ckpt:
        for _ in range(2):
            train_step(model, opt, sched, sampler)
            ckpt.step()
    model, opt, sched, sampler = make_run(seed=3)
    train_step(model, opt, sched, sampler)
    before, sched_before = snapshot(model, opt), sched.state_dict()
    with pytest.raises(RuntimeError, match="this sampler refuses its state"):
        load(str(tmp_path), model, opt, stateful={"a_sched": sched, "b_sampler": _RefusingSampler()})
    _assert_same(before, model, opt)
    assert sched.state_dict() == sched_before
