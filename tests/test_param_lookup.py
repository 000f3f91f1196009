"""The optimizer's groups a load hands torch: set lookups for "is this parameter in this group", everything else a list's.

torch's ``Optimizer.load_state_dict`` scans every saved group's ``params`` list once per
state value (and DCP's ``_split_optim_state_dict`` once per parameter name): quadratic in
the parameters, 4.4 s of a 30,000-tensor load. ``restore/param_lookup.py`` hands it
:class:`ParamList`s; these tests pin that it does, that the result is the stock one bit
for bit, and that the user's own load hooks see the groups as they came.
"""

from __future__ import annotations

import copy
import pickle
from pathlib import Path

import pytest
import torch
from torch import nn

from overlapckpt import Checkpointer, load
from overlapckpt.restore.param_lookup import ParamList, optimizer_state_with_param_lists, param_lists_while_loading


def _model_and_optimizer(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    opt = torch.optim.AdamW(
        [{"params": list(model[0].parameters()), "lr": 1e-2}, {"params": list(model[1].parameters()), "lr": 3e-3, "weight_decay": 0.5}]
    )
    for _ in range(2):
        model(torch.randn(5, 4)).square().sum().backward()
        opt.step()
    return model, opt


def test_param_list_answers_membership_as_a_list_does_through_changes():
    ids = ParamList([3, 1, 2])
    assert 1 in ids and 4 not in ids and ids == [3, 1, 2] and list(ids) == [3, 1, 2]
    ids.append(4)
    assert 4 in ids
    ids[0] = 7
    assert 7 in ids and 3 not in ids
    del ids[0]
    assert 7 not in ids and ids == [1, 2, 4]
    ids.extend([9])
    assert 9 in ids
    assert [0] not in ids  # an unhashable probe is answered by the list's own scan, not a TypeError


def test_param_list_changes_that_keep_its_length_are_seen():
    ids = ParamList(["x", "y"])
    assert "x" in ids
    ids.append("z")
    ids.pop(0)  # the same length as when "x" was looked up
    assert "x" not in ids and "z" in ids
    ids.remove("z")
    ids.insert(0, "w")
    assert "w" in ids and "z" not in ids
    ids += ["v"]
    ids.clear()
    assert "v" not in ids and "w" not in ids


def test_param_list_of_unhashable_items_scans_as_a_list():
    items = ParamList([[1], [2]])
    assert [2] in items and [3] not in items


def test_param_list_survives_deepcopy_and_pickle_as_an_equal_list():
    names = ParamList(["a.weight", "a.bias"])
    for again in (copy.deepcopy(names), pickle.loads(pickle.dumps(names))):
        assert again == ["a.weight", "a.bias"] and "a.bias" in again and "b" not in again


def test_only_the_groups_params_change_and_the_callers_dict_is_not_touched():
    params = [0, 1]
    osd = {"state": {0: {}}, "param_groups": [{"params": params, "lr": 0.1}]}
    out = optimizer_state_with_param_lists(osd)
    assert type(out["param_groups"][0]["params"]) is ParamList
    assert out["param_groups"][0] == {"params": [0, 1], "lr": 0.1} and out["state"] is osd["state"]
    assert osd["param_groups"][0]["params"] is params and type(params) is list
    assert optimizer_state_with_param_lists(None) is None
    assert optimizer_state_with_param_lists({"state": {}}) == {"state": {}}


def test_the_hook_goes_after_the_users_own_and_is_removed_even_on_a_failure():
    _, opt = _model_and_optimizer(0)
    seen: list[type] = []
    opt.register_load_state_dict_pre_hook(lambda _o, sd: seen.append(type(sd["param_groups"][0]["params"])))
    state = opt.state_dict()
    with pytest.raises(RuntimeError, match="on purpose"):
        with param_lists_while_loading([opt]):
            opt.load_state_dict(state)
            raise RuntimeError("on purpose")
    assert seen == [list]  # the user's hook saw the groups as they came
    assert len(opt._optimizer_load_state_dict_pre_hooks) == 1  # only the user's is left


def test_torchs_per_value_lookup_scans_a_set_during_a_load(tmp_path: Path, monkeypatch):
    """Before param_lookup.py the lookups torch made per state value scanned plain lists."""
    model, opt = _model_and_optimizer(0)
    with Checkpointer(model, opt, str(tmp_path), lease=False) as ckpt:
        ckpt.request()
        ckpt.wait(timeout_s=120)
    lookups: list[type] = []
    policy = torch.optim.Optimizer._process_value_according_to_param_policy

    def recorded(param, value, param_id, param_groups, key=None):
        lookups.extend(type(group["params"]) for group in param_groups)
        return policy(param, value, param_id, param_groups, key)

    monkeypatch.setattr(torch.optim.Optimizer, "_process_value_according_to_param_policy", staticmethod(recorded))
    fresh_model, fresh_opt = _model_and_optimizer(1)
    load(str(tmp_path), fresh_model, fresh_opt)
    assert lookups and set(lookups) == {ParamList}


def test_a_load_sets_the_optimizer_as_stock_set_state_dict_does(tmp_path: Path):
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = _model_and_optimizer(0)
    with Checkpointer(model, opt, str(tmp_path), lease=False) as ckpt:
        ckpt.request()
        ckpt.wait(timeout_s=120)
    ours_model, ours_opt = _model_and_optimizer(1)
    load(str(tmp_path), ours_model, ours_opt)
    stock_model, stock_opt = _model_and_optimizer(1)
    msd, osd = get_state_dict(model, opt)
    set_state_dict(stock_model, stock_opt, model_state_dict=msd, optim_state_dict=osd)
    ours, stock = ours_opt.state_dict(), stock_opt.state_dict()
    assert ours["param_groups"] == stock["param_groups"]
    assert all(type(g["params"]) is list for g in ours_opt.param_groups)
    for pid, values in stock["state"].items():
        for key, value in values.items():
            assert torch.equal(ours["state"][pid][key], value), (pid, key)
    assert all(torch.equal(a, b) for a, b in zip(ours_model.state_dict().values(), stock_model.state_dict().values()))
    assert len(ours_opt._optimizer_load_state_dict_pre_hooks) == 0
