"""Several torch optimizers that one container steps, seen by the engine as one optimizer.

TorchTitan's ``OptimizersContainer`` is a ``torch.optim.Optimizer`` whose ``step()`` steps
one optimizer per model part (pipeline stages) and per optimizer type. Its own
``state`` is empty and its one param group carries no hyperparameters: the state and
the groups live in the optimizers inside. So the engine hooks the container's
``step()`` (which fires the container's pre-hooks, MoE load balancing among them,
before any inner optimizer runs) and reads the inner optimizers' groups and state,
live, through this view.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch


class _MergedState(Mapping[torch.Tensor, dict[str, Any]]):
    """``optimizer.state`` of every inner optimizer, read through one mapping (a parameter is in one of them)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self._optimizers = optimizers

    def __getitem__(self, p: torch.Tensor) -> dict[str, Any]:
        for o in self._optimizers:
            # `in` first: reading a defaultdict with [] would add an empty entry to it.
            if p in o.state:
                return o.state[p]
        raise KeyError(p)

    def __iter__(self) -> Iterator[torch.Tensor]:
        for o in self._optimizers:
            yield from o.state

    def __len__(self) -> int:
        return sum(len(o.state) for o in self._optimizers)


class OptimizerGroup:
    """The optimizers ``owner.step()`` steps: their param groups and state, live; hooked on ``owner``."""

    def __init__(self, owner: torch.optim.Optimizer, optimizers: list[torch.optim.Optimizer]) -> None:
        self.step_owner = owner
        self.optimizers = list(optimizers)
        self.state = _MergedState(self.optimizers)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """Every inner optimizer's groups, in order (the same dicts: hyperparameters are read live)."""
        return [g for o in self.optimizers for g in o.param_groups]

    @property
    def update_rule(self) -> type | None:
        """The one optimizer class of all inner optimizers (what replay steps), or None when they differ."""
        kinds = {type(o) for o in self.optimizers}
        return kinds.pop() if len(kinds) == 1 else None

    def describe(self) -> str:
        owner = type(self.step_owner)
        inner = ", ".join(sorted({f"{type(o).__module__}.{type(o).__qualname__}" for o in self.optimizers}))
        return f"{owner.__module__}.{owner.__qualname__} of [{inner}]"


def as_optimizer_group(optimizer: torch.optim.Optimizer) -> OptimizerGroup | None:
    """A view over ``optimizer`` when it is a container that steps optimizers it holds, else None."""
    inner = getattr(optimizer, "optimizers", None)
    if (
        isinstance(inner, list)
        and inner
        and all(isinstance(o, torch.optim.Optimizer) and o is not optimizer for o in inner)
        and not optimizer.state  # the container keeps no state of its own: the inner optimizers do
    ):
        return OptimizerGroup(optimizer, inner)
    return None


def step_owner(optimizer: Any) -> torch.optim.Optimizer:
    """The optimizer whose ``step()`` fires the hooks: the container for a group, else the optimizer."""
    return optimizer.step_owner if isinstance(optimizer, OptimizerGroup) else optimizer


def update_rule_class(optimizer: Any) -> type | None:
    """The class whose update rule steps this state (None: a group of different optimizers)."""
    return optimizer.update_rule if isinstance(optimizer, OptimizerGroup) else type(optimizer)


def describe_optimizer(optimizer: Any) -> str:
    """The optimizer's class by its full name (a group: the container's and its optimizers')."""
    if isinstance(optimizer, OptimizerGroup):
        return optimizer.describe()
    return f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"


def update_rule_name(optimizer: Any) -> str:
    """What a checkpoint's optimizer state means, by name: the nearest ``torch.optim`` class the optimizer derives
    from (a subclass that adds hooks or logging reads the same state), else its own class; a group: each inner one's.

    Recorded in the manifest and compared by ``load``: an AdamW checkpoint does not load into Adam.
    """
    if isinstance(optimizer, OptimizerGroup):
        return "[" + ", ".join(sorted({_rule_name(type(o)) for o in optimizer.optimizers})) + "]"
    return _rule_name(type(optimizer))


def _rule_name(cls: type) -> str:
    rule = next((c for c in cls.__mro__ if c.__module__.startswith("torch.optim.") and c is not torch.optim.Optimizer), cls)
    return f"{rule.__module__}.{rule.__qualname__}"


def torch_optimizers(optimizer: Any) -> Any:
    """What ``torch.distributed.checkpoint.state_dict`` takes: the optimizer, or a group's optimizers as a tuple."""
    return tuple(optimizer.optimizers) if isinstance(optimizer, OptimizerGroup) else optimizer
