"""The layout is rebuilt exactly when a live tensor was replaced (live_identity.py), and never for nothing.

Each change below replaces something a layout holds a reference to; a stale layout would copy
the old tensor, which training no longer updates, into every later checkpoint. The end-to-end
tests check the checkpoint itself, bit for bit, against the live state at its step.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from overlapckpt import load
from overlapckpt.seams import Checkpointer
from overlapckpt.train.copying.live_identity import LiveIdentity

from tensor_roads import ROADS, take_road


@pytest.fixture(autouse=True, params=ROADS)
def road(request, monkeypatch):
    """Every test here on both roads of the passes (tensor_passes.py): native and the Python twins."""
    take_road(request.param, monkeypatch)
    return request.param


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.register_buffer("running", torch.zeros(3))
        self.register_buffer("cache", torch.zeros(2), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def _stepped() -> tuple[Net, torch.optim.AdamW]:
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_an_unchanged_state_matches_and_so_does_an_empty_entry_the_defaultdict_adds():
    model, optimizer = _stepped()
    frozen = nn.Parameter(torch.ones(2))
    optimizer.add_param_group({"params": [frozen]})  # never stepped: no state
    identity = LiveIdentity.capture(model, optimizer)
    assert identity.matches()
    assert optimizer.state[frozen] == {}  # reading it adds an empty entry: no state
    assert identity.matches()
    assert identity.matches()


def test_every_replacement_a_layout_must_follow_is_seen():
    def replace_buffer(model: Net, optimizer: torch.optim.Optimizer) -> None:
        model.running = torch.ones(3)

    def replace_state(model: Net, optimizer: torch.optim.Optimizer) -> None:
        optimizer.state[model.lin.weight]["exp_avg"] = torch.zeros(3, 4)

    def load_optimizer(model: Net, optimizer: torch.optim.Optimizer) -> None:
        optimizer.load_state_dict(optimizer.state_dict())

    def new_data(model: Net, optimizer: torch.optim.Optimizer) -> None:
        model.lin.weight.data = model.lin.weight.data.double()

    def new_parameter(model: Net, optimizer: torch.optim.Optimizer) -> None:
        model.lin.bias = nn.Parameter(torch.zeros(3))

    def new_submodule(model: Net, optimizer: torch.optim.Optimizer) -> None:
        model.extra = nn.Linear(1, 1)

    def state_created(model: Net, optimizer: torch.optim.Optimizer) -> None:
        optimizer.state[model.lin.bias]["extra"] = torch.zeros(1)

    def new_persistent_buffer(model: Net, optimizer: torch.optim.Optimizer) -> None:
        model.register_buffer("more", torch.zeros(1))

    for change in (replace_buffer, replace_state, load_optimizer, new_data, new_parameter, new_submodule, state_created, new_persistent_buffer):
        model, optimizer = _stepped()
        identity = LiveIdentity.capture(model, optimizer)
        change(model, optimizer)
        assert not identity.matches(), change.__name__


def test_a_state_value_moved_to_the_next_parameters_dict_is_seen():
    # The chained values stay the very objects in the same order; only the per-parameter
    # dicts' lengths show that exp_avg_sq now belongs to the bias (before, this matched).
    model, optimizer = _stepped()
    identity = LiveIdentity.capture(model, optimizer)
    weight_state, bias_state = optimizer.state[model.lin.weight], optimizer.state[model.lin.bias]
    assert list(weight_state)[-1] == "exp_avg_sq"
    moved = weight_state.pop("exp_avg_sq")
    kept = list(bias_state.items())
    bias_state.clear()
    bias_state["exp_avg_sq_of_weight"] = moved
    bias_state.update(kept)
    assert not identity.matches()


def test_a_non_persistent_buffer_or_a_python_number_in_the_state_changing_is_no_replacement():
    model, optimizer = _stepped()
    optimizer.state[model.lin.weight]["calls"] = 1  # a non-tensor state value, as some optimizers keep
    identity = LiveIdentity.capture(model, optimizer)
    model.cache = torch.ones(2)  # a rotary cache, say: not checkpoint state
    optimizer.state[model.lin.weight]["calls"] = 2
    assert identity.matches()
    optimizer.state[model.lin.weight]["calls"] = torch.tensor(2)  # now a tensor: state to copy
    assert not identity.matches()


def _train_and_checkpoint(tmp_path, change) -> tuple[dict[int, dict[str, torch.Tensor]], dict[int, dict]]:
    """Checkpoint at steps 2 and 4; ``change`` runs between them. Returns the live state at each."""
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    live_model: dict[int, dict[str, torch.Tensor]] = {}
    live_optim: dict[int, dict] = {}
    with Checkpointer(model, optimizer, tmp_path, every=2, keep=2) as ckpt:
        for step in range(1, 5):
            model.running.add_(1.0)  # in the forward, as BatchNorm's running stats
            model(torch.randn(5, 4)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            ckpt.step()
            if step % 2 == 0:
                live_model[step] = {k: v.clone() for k, v in model.state_dict().items()}
                live_optim[step] = {k: {n: t.clone() for n, t in s.items()} for k, s in optimizer.state_dict()["state"].items()}
                ckpt.wait(timeout_s=60)
            if step == 2:
                change(model, optimizer)
    return live_model, live_optim


def test_a_checkpoint_after_a_buffer_is_reassigned_holds_the_new_buffer(tmp_path):
    def reassign(model: Net, optimizer: torch.optim.Optimizer) -> None:
        model.running = torch.full((3,), 100.0)  # the old tensor is no longer updated

    live_model, _ = _train_and_checkpoint(tmp_path, reassign)
    fresh = Net()
    load(tmp_path, fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-2, foreach=True), step=4)
    assert torch.equal(fresh.running, live_model[4]["running"])
    assert torch.equal(fresh.running, torch.full((3,), 102.0))


def test_a_checkpoint_after_the_optimizer_loaded_a_state_dict_holds_the_loaded_state(tmp_path):
    def reload(model: Net, optimizer: torch.optim.Optimizer) -> None:
        sd = optimizer.state_dict()
        for s in sd["state"].values():
            s["exp_avg"] = s["exp_avg"] * 3  # new tensors, new values: a stale layout copies the old ones
        optimizer.load_state_dict(sd)

    live_model, live_optim = _train_and_checkpoint(tmp_path, reload)
    fresh = Net()
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2, foreach=True)
    load(tmp_path, fresh, fresh_optimizer, step=4)
    for k, v in live_model[4].items():
        assert torch.equal(fresh.state_dict()[k], v), k
    for index, state in live_optim[4].items():
        for name, t in state.items():
            assert torch.equal(fresh_optimizer.state_dict()["state"][index][name], t), (index, name)


def test_an_optimizer_container_matches_until_one_of_its_optimizers_loads_a_state_dict():
    """TorchTitan's OptimizersContainer lists its optimizers' groups anew at each read: no rebuild for that."""
    from overlapckpt.optimizers import OptimizerGroup

    torch.manual_seed(0)
    model = Net()
    inner = [torch.optim.AdamW([model.lin.weight], lr=1e-2), torch.optim.SGD([model.lin.bias], lr=0.1, momentum=0.9)]
    model(torch.randn(5, 4)).sum().backward()
    for o in inner:
        o.step()
    group = OptimizerGroup(inner[0], inner)
    identity = LiveIdentity.capture(model, group)  # type: ignore[arg-type]
    assert group.param_groups is not group.param_groups  # a new list per read
    assert identity.matches() and identity.matches()
    inner[1].load_state_dict(inner[1].state_dict())
    assert not identity.matches()
