"""Bad input gets a clear error naming the value and the fix."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from overlapckpt import (
    Checkpointer,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    load,
)
from overlapckpt.errors import (
    UnsupportedOptimizerError,
)
from overlapckpt.format.extra_state import tensor_bytes

from helpers import TinyNet, make_run, train_step


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"window": 0}, r"window=0 is invalid; pass an integer >= 1"),
        ({"window": -2}, r"window=-2 is invalid"),
        ({"window": "fast"}, r"window='fast' is invalid; pass an integer >= 1 \(.*, or 'auto'\)"),
        ({"window": "auto", "max_window": 0}, r"max_window=0 is invalid; pass an integer >= 1"),
        ({"keep": 0}, r"keep=0 is invalid; pass an integer >= 1"),
        ({"writer_threads": 0}, r"writer_threads=0 is invalid; pass an integer >= 1 \(the writer process's threads"),
        ({"max_inflight": 0}, r"max_inflight=0 is invalid; pass an integer >= 1 \(snapshots in flight at once, .*; or 'auto'\)"),
        ({"max_inflight": "two"}, r"max_inflight='two' is invalid; pass an integer >= 1 \(.*; or 'auto'\)"),
        ({"every": 0}, r"every=0 is invalid"),
        ({"window": 2, "consistency": "exact"}, r"consistency='exact' is invalid; use 'replay' or 'stage'"),
    ],
)
def test_bad_numbers(tmp_path, kwargs, message):
    model, opt, _, _ = make_run()
    with pytest.raises(ConfigError, match=message):
        Checkpointer(model, opt, tmp_path, **kwargs)


def test_path_that_is_a_file(tmp_path):
    f = tmp_path / "not-a-dir"
    f.write_text("x")
    model, opt, _, _ = make_run()
    with pytest.raises(ConfigError, match="is an existing file; pass a directory"):
        Checkpointer(model, opt, f)


def test_optimizer_over_other_params(tmp_path):
    model, _, _, _ = make_run()
    other = nn.Linear(3, 3)
    opt = torch.optim.SGD(other.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match=r"param_groups\[0\]\['params'\]\[0\] \(shape \(3, 3\)\) is not a parameter of the model"):
        Checkpointer(model, opt, tmp_path)


def test_stateful_without_state_dict(tmp_path):
    model, opt, _, _ = make_run()
    with pytest.raises(ConfigError, match=r"stateful\['loader'\] is a object without state_dict\(\)"):
        Checkpointer(model, opt, tmp_path, stateful={"loader": object()})


def test_stateful_with_unstorable_state(tmp_path):
    class Weird:
        def state_dict(self):
            return {"fn": lambda: 1}

        def load_state_dict(self, s):
            pass

    model, opt, _, _ = make_run()
    with pytest.raises(ConfigError, match=r"stateful\['w'\].state_dict\(\)\['fn'\] is a function"):
        Checkpointer(model, opt, tmp_path, stateful={"w": Weird()})


def test_replay_refuses_lbfgs(tmp_path):
    model = TinyNet()
    opt = torch.optim.LBFGS(model.parameters())
    with pytest.raises(UnsupportedOptimizerError, match=r"torch.optim.lbfgs.LBFGS cannot be replayed.*Use window=1, or window>1 or 'auto' with consistency='stage'"):
        Checkpointer(model, opt, tmp_path, window=4, consistency="replay")


def test_request_before_first_step(tmp_path):
    model, opt, _, _ = make_run()
    with Checkpointer(model, opt, tmp_path) as ckpt:
        with pytest.raises(ConfigError, match="before the first optimizer.step"):
            ckpt.request()


def _saved(tmp_path):
    model, opt, sched, sampler = make_run()
    with Checkpointer(model, opt, tmp_path) as ckpt:
        train_step(model, opt, sched, sampler)
        ckpt.request()
        (info,) = ckpt.wait(timeout_s=120)
    return info


def test_load_into_different_shapes_names_the_tensor(tmp_path):
    _saved(tmp_path)
    model, opt, _, _ = make_run(width=32)
    before = model.inp.weight.detach().clone()
    with pytest.raises(CheckpointMismatchError, match=r"tensor 'model.inp.weight' has shape \(16, 8\) in the checkpoint but \(32, 8\)"):
        load(str(tmp_path), model, opt)
    assert torch.equal(model.inp.weight, before)  # nothing was changed


def test_corrupted_tensor_bytes_name_the_item(tmp_path):
    model, opt, sched, sampler = make_run()
    with Checkpointer(model, opt, tmp_path) as ckpt:
        train_step(model, opt, sched, sampler)
        ckpt.request()
        stored = tensor_bytes(model.inp.weight.detach().contiguous())
        (info,) = ckpt.wait(timeout_s=120)
    shard = tmp_path / "step-000000001" / "__0_0.distcp"
    raw = bytearray(shard.read_bytes())
    pos = raw.find(stored)
    assert pos >= 0  # precondition: the tensor's bytes are stored verbatim in the shard
    raw[pos + 17] ^= 0x01  # one flipped bit
    shard.write_bytes(bytes(raw))
    fresh, fresh_opt, _, _ = make_run(seed=3)
    before = fresh.inp.weight.detach().clone()
    with pytest.raises(CorruptCheckpointError, match=r"checksum mismatch for 'model.inp.weight' in .*step-000000001"):
        load(str(tmp_path), fresh, fresh_opt)
    assert torch.equal(fresh.inp.weight, before)  # a corrupt checkpoint changes nothing
    assert load(str(tmp_path), fresh, fresh_opt, verify=False).step == info.step


def test_truncated_shard_is_corrupt(tmp_path):
    _saved(tmp_path)
    shard = tmp_path / "step-000000001" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    model, opt, _, _ = make_run(seed=3)
    with pytest.raises(CorruptCheckpointError, match=r"reading the checkpoint .*step-000000001 failed"):
        load(str(tmp_path), model, opt)


def test_missing_checkpoint(tmp_path):
    model, opt, _, _ = make_run()
    with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint under"):
        load(str(tmp_path), model, opt)
    _saved(tmp_path)
    with pytest.raises(CheckpointNotFoundError, match=r"no committed checkpoint of step 7 .* committed steps are \[1\]"):
        load(str(tmp_path), model, opt, step=7)


def test_every_error_derives_from_the_base_and_the_public_ones_are_the_same_types():
    import inspect

    import overlapckpt
    from overlapckpt import errors

    defined = {name for name, obj in inspect.getmembers(errors, inspect.isclass) if obj.__module__ == errors.__name__}
    assert all(issubclass(getattr(errors, name), overlapckpt.OverlapCkptError) for name in defined)
    # The top level exports the errors a training script catches (the rest stay in overlapckpt.errors), as the same types.
    exported = {n for n in overlapckpt.__all__ if n.endswith("Error")}
    assert exported <= defined and all(getattr(overlapckpt, n) is getattr(errors, n) for n in exported)
    assert len(overlapckpt.__all__) - len(exported) == 8  # Checkpointer, CheckpointerSettings, CheckpointInfo, LoadTargets, CheckpointStore, list_checkpoints, load, set_verbosity
    # Errors are defined only in errors.py: no other module of the package defines an exception class.
    import pkgutil

    for info in pkgutil.walk_packages(overlapckpt.__path__, "overlapckpt."):
        if info.name.endswith((".__main__", ".writer.process")):
            continue
        module = __import__(info.name, fromlist=["_"])
        strays = [
            n for n, c in inspect.getmembers(module, inspect.isclass)
            if issubclass(c, BaseException) and c.__module__ == module.__name__ and module is not errors
        ]
        assert not strays, f"{info.name} defines {strays}; define errors in overlapckpt/errors.py"


@pytest.fixture
def saved_adamw(tmp_path):
    """A committed checkpoint of an AdamW run with no scheduler, and one of a run with a StepLR in stateful=."""
    model, opt = _bare_adamw()
    with Checkpointer(model, opt, tmp_path / "plain") as ckpt:
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        ckpt.request()
        ckpt.wait(timeout_s=120)
    model, opt, _, sampler = make_run()
    step_lr = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
    with Checkpointer(model, opt, tmp_path / "with-scheduler", stateful={"sched": step_lr}) as ckpt:
        train_step(model, opt, step_lr, sampler)
        train_step(model, opt, step_lr, sampler)
        ckpt.request()
        ckpt.wait(timeout_s=120)
    return tmp_path / "plain", tmp_path / "with-scheduler"


def _bare_adamw(optimizer=torch.optim.AdamW):
    torch.manual_seed(0)
    model = TinyNet()
    return model, optimizer(model.parameters(), lr=1e-2)


def test_mismatches_are_named_mismatches_not_corruption(saved_adamw):
    plain, with_scheduler = saved_adamw
    # A scheduler attached to the live optimizer adds initial_lr: before, CorruptCheckpointError ("Missing key").
    model, opt = _bare_adamw()
    torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    with pytest.raises(CheckpointMismatchError, match=r"\['optimizer.param_groups.0.initial_lr'\] .* an LR scheduler attached to the optimizer adds 'initial_lr'"):
        load(str(plain), model, opt)
    # An AdamW checkpoint into Adam: before, loaded silently.
    model, adam = _bare_adamw(torch.optim.Adam)
    with pytest.raises(CheckpointMismatchError, match=r"holds the state of a torch.optim.adamw.AdamW, and is loaded into a torch.optim.adam.Adam.*optimizer=None"):
        load(str(plain), model, adam)
    assert load(str(plain), model, None).step == 1  # the model alone still loads
    # A checkpoint with a scheduler, loaded without stateful=: before, the lr came back and last_epoch stayed 0, silently.
    model, opt, _, _ = make_run(seed=3)
    with pytest.warns(UserWarning, match=r"holds stateful objects \['sched'\] that load\(\) was not given: they are not restored"):
        load(str(with_scheduler), model, opt)


def test_a_scheduler_passed_as_the_optimizer_is_refused(saved_adamw, tmp_path):
    plain, _ = saved_adamw
    model, opt, _, _ = make_run()
    scheduler = torch.optim.lr_scheduler.StepLR(opt, 1)
    message = r"optimizer is a StepLR, an LR scheduler, not the optimizer it schedules: pass its optimizer \(scheduler.optimizer\)"
    with pytest.raises(ConfigError, match=message):
        Checkpointer(model, scheduler, tmp_path / "x")
    with pytest.raises(ConfigError, match=message):
        load(str(plain), model, scheduler)


def test_a_model_on_meta_and_a_path_that_is_no_path_are_refused_at_construction(tmp_path):
    with torch.device("meta"):
        model = TinyNet()
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ConfigError, match=r"the model's \['inp.weight', 'inp.bias', 'norm.weight'\] ... are on the meta device"):
        Checkpointer(model, opt, tmp_path)  # before: accepted, then a raw NotImplementedError after training
    model, opt, _, _ = make_run()
    with pytest.raises(ConfigError, match=r"path=123 is invalid; pass the checkpoint root"):
        Checkpointer(model, opt, 123)  # before: a raw TypeError
