"""Which optimizer a Checkpointer hooks and a checkpoint holds: wrappers unwrapped, containers seen as one, update rules named.

Shared by the training side (the hooks, replay's refusals) and the restore side (``load``
restores into the same optimizer the hooks would find, and checks its update rule
against the one a checkpoint records), so neither imports the other.

``unwrap_optimizer`` finds the ``torch.optim.Optimizer`` whose ``step()`` fires step
hooks inside Accelerate's and Lightning's wrappers. TorchTitan's ``OptimizersContainer``
is a ``torch.optim.Optimizer`` whose ``step()`` steps one optimizer per model part
(pipeline stages) and per optimizer type. Its own ``state`` is empty and its one param
group carries no hyperparameters: the state and the groups live in the optimizers
inside. So the engine hooks the container's ``step()`` (which fires the container's
pre-hooks, MoE load balancing among them, before any inner optimizer runs) and reads the
inner optimizers' groups and state, live, through an ``OptimizerGroup``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from .errors import ConfigError

# Optimizers whose update is elementwise per tensor, so a subset of parameters can be
# stepped on its own and the result is the same as inside the full step (replay).
REPLAYABLE_OPTIMIZERS = frozenset(
    {"SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Adadelta", "Adamax", "NAdam", "RAdam", "ASGD", "Rprop", "Adafactor"}
)


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


def each_optimizer(optimizers: Any) -> list[torch.optim.Optimizer]:
    """``torch_optimizers``' value (None, one optimizer, or a group's tuple) as a list of the optimizers."""
    if optimizers is None:
        return []
    return list(optimizers) if isinstance(optimizers, tuple) else [optimizers]


_WRAPPER_ATTRIBUTES = ("optimizer", "_optimizer")
_MAX_WRAPPER_DEPTH = 8


def unwrap_optimizer(optimizer: Any) -> Any:
    """The ``torch.optim.Optimizer`` whose ``step()`` fires step hooks, inside any wrappers around it.

    Accelerate's ``AcceleratedOptimizer`` and Lightning's ``LightningOptimizer`` subclass
    or imitate an optimizer without registering its hooks; they step the optimizer
    they hold as ``.optimizer`` / ``._optimizer``, which is the one to hook and replay.
    A container that steps optimizers it holds (TorchTitan's ``OptimizersContainer``)
    becomes an ``OptimizerGroup``: hooked on its own step, its state read from inside.
    """
    if isinstance(optimizer, (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)):
        raise ConfigError(
            f"optimizer is a {type(optimizer).__qualname__}, an LR scheduler, not the optimizer it schedules: pass its "
            "optimizer (scheduler.optimizer) as optimizer, and the scheduler in stateful={'scheduler': scheduler}"
        )
    current = optimizer
    for _ in range(_MAX_WRAPPER_DEPTH):
        if fires_step_hooks(current):
            return as_optimizer_group(current) or current
        inner = next(
            (getattr(current, a) for a in _WRAPPER_ATTRIBUTES if isinstance(getattr(current, a, None), torch.optim.Optimizer)),
            None,
        )
        if inner is None or inner is current:
            break
        current = inner
    kind = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
    raise ConfigError(
        f"optimizer is a {kind}, whose step() cannot be hooked: it is not a torch.optim.Optimizer that fires "
        "step hooks, and it exposes none as .optimizer or ._optimizer. Pass the torch.optim.Optimizer that "
        "it steps"
    )


def fires_step_hooks(optimizer: Any) -> bool:
    """Whether ``optimizer.step()`` runs torch's step pre- and post-hooks."""
    return (
        isinstance(optimizer, torch.optim.Optimizer)
        and isinstance(vars(optimizer).get("_optimizer_step_pre_hooks"), dict)
        and bool(getattr(type(optimizer).step, "hooked", False))
    )
