"""Whether the live tensors a layout holds are still the ones training updates.

A layout keeps references to the live tensors: parameters, buffers, optimizer state.
Anything that replaces one makes it stale:

* ``optimizer.load_state_dict`` (a new state mapping, new state tensors);
* a state entry created lazily (a parameter stepped for the first time), or replaced;
* a parameter, persistent buffer or submodule reassigned on a module;
* ``module.to(dtype)`` or ``param.data = ...``, which keep the Parameter object but
  give it other storage (its data pointer moves);
* a DTensor whose local shard was swapped.

The check runs at every snapshot start, inside ``optimizer.step()``, and a
Mixture-of-Experts rank holds tens of thousands of tensors. So it runs no Python per
tensor: the containers are gathered once, when the layout is built, and a check is a
few passes over them (``tensor_passes.py``: a loop each in the native extension where it
is built, else passes in C over ``map`` and ``operator.is_``), with no hashing of tensors
(``Tensor.__hash__`` is Python). At 30,000 tensors the twins cost about 4 ms where walking
``state_dict()`` cost 60.

What it does not see: ``.data`` reassigned on an optimizer *state* tensor (the object
stays, so the copies read its new storage; only a new dtype or shape would matter, and
nothing in torch's optimizers does that).
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from . import tensor_passes
from .ownership import is_dtensor
from .tensor_passes import DataPointers

_generations = itertools.count(1)
_chain = itertools.chain.from_iterable


def new_generation() -> int:
    """A number no earlier layout of this process had: the key its plans, views and routes are cached under."""
    return next(_generations)


def _same(now: Sequence[Any] | Any, then: Sequence[Any]) -> bool:
    """Whether ``now`` holds the very objects of ``then``, in order: the twin pass of ``tensor_passes.same_items``
    for the short lists (param groups, picked state tensors, buffers, local shards) not worth a native call."""
    return tensor_passes.same_items_python(list(now), then)


def _picker(positions: Sequence[int]) -> Callable[[Sequence[Any]], tuple[Any, ...]]:
    """``itemgetter`` that always returns a tuple (itemgetter of one index returns the item)."""
    if not positions:
        return lambda seq: ()
    if len(positions) == 1:
        only = positions[0]
        return lambda seq: (seq[only],)
    return operator.itemgetter(*positions)


@dataclass(eq=False)
class _PartialBuffers:
    """A module with non-persistent buffers (a rotary cache): only its persistent ones are state."""

    buffers: dict[str, Any]
    names: tuple[str, ...]  # every buffer's name, in order, when captured
    pick: Callable[[Sequence[Any]], tuple[Any, ...]]  # the persistent ones among their values
    persistent: tuple[Any, ...]


@dataclass(eq=False)
class LiveIdentity:
    """The objects a layout was built from, and the containers to read them again from."""

    optimizer: torch.optim.Optimizer
    state_mapping: dict[Any, Any]  # optimizer.state itself: load_state_dict replaces it
    param_groups: list[dict[str, Any]]  # optimizer.param_groups' dicts (a container's property builds a new list per read)
    params: list[torch.Tensor]  # every optimized parameter, in optimizer order
    state_keys: list[Any]  # optimizer.state's keys and per-parameter dicts, in its own order
    state_dicts: list[dict[str, Any]]
    state_lengths: list[int]
    state_values: list[Any]  # every state value, chained in that order
    tensor_values_only: bool  # every one is a tensor (Adam's step too): compared by identity
    state_types: list[type]  # otherwise their types, and the tensors among them by identity
    pick_state_tensors: Callable[[Sequence[Any]], tuple[Any, ...]]
    state_tensors: tuple[Any, ...]
    model_dicts: list[dict[str, Any]]  # every module's _parameters and _modules, and _buffers where all persist
    model_lengths: list[int]
    model_values: list[Any]
    partial_buffers: list[_PartialBuffers]
    plain_params: list[torch.Tensor]  # non-DTensor parameters: their data pointers
    param_ptrs: DataPointers
    dtensors: list[torch.Tensor]  # DTensor parameters and state: their local shards' identities
    local_shards: list[torch.Tensor]

    @classmethod
    def capture(cls, model: nn.Module, optimizer: torch.optim.Optimizer) -> LiveIdentity:
        state: dict[Any, Any] = optimizer.state
        state_dicts = list(state.values())
        values = list(_chain(map(dict.values, state_dicts)))
        tensor_positions = [k for k, v in enumerate(values) if isinstance(v, torch.Tensor)]
        pick = _picker(tensor_positions)
        model_dicts: list[dict[str, Any]] = []
        partial: list[_PartialBuffers] = []
        for module in model.modules():
            model_dicts += [module._parameters, module._modules]
            skipped = module._non_persistent_buffers_set
            if not skipped:
                model_dicts.append(module._buffers)
                continue
            # Reassigning a non-persistent buffer must not rebuild the layout: it is not checkpoint state.
            names = tuple(module._buffers)
            picker = _picker([k for k, n in enumerate(names) if n not in skipped])
            partial.append(_PartialBuffers(module._buffers, names, picker, picker(list(module._buffers.values()))))
        params = list(_chain(g["params"] for g in optimizer.param_groups))
        plain = [p for p in params if not is_dtensor(p)]
        dtensors = [t for t in params + [values[k] for k in tensor_positions] if is_dtensor(t)]
        return cls(
            optimizer=optimizer,
            state_mapping=state,
            param_groups=list(optimizer.param_groups),
            params=params,
            state_keys=list(state.keys()),
            state_dicts=state_dicts,
            state_lengths=list(map(len, state_dicts)),
            state_values=values,
            tensor_values_only=len(tensor_positions) == len(values),
            state_types=list(map(type, values)),
            pick_state_tensors=pick,
            state_tensors=pick(values),
            model_dicts=model_dicts,
            model_lengths=list(map(len, model_dicts)),
            model_values=list(_chain(map(dict.values, model_dicts))),
            partial_buffers=partial,
            plain_params=plain,
            param_ptrs=DataPointers(plain),
            dtensors=dtensors,
            local_shards=list(map(operator.attrgetter("_local_tensor"), dtensors)),
        )

    def matches(self) -> bool:
        """Whether every tracked tensor is still the one captured (no tensor data is read)."""
        optimizer = self.optimizer
        state = optimizer.state
        # The groups by identity: load_state_dict makes new ones, and a container (TorchTitan's
        # OptimizersContainer, as an OptimizerGroup) lists its optimizers' groups anew at each read.
        if state is not self.state_mapping or not _same(optimizer.param_groups, self.param_groups):
            return False
        if not tensor_passes.same_items(list(_chain(g["params"] for g in self.param_groups)), self.params):
            return False
        # Its values alone: a key cannot change under the same per-parameter dict without moving it.
        if not tensor_passes.same_items(list(state.values()), self.state_dicts):
            # optimizer.state is a defaultdict: reading state[p] anywhere adds an empty entry,
            # which is no state. Only then is it the same; remember it, so this runs once.
            captured = {id(k): id(d) for k, d in zip(self.state_keys, self.state_dicts) if d}
            if {id(k): id(d) for k, d in state.items() if d} != captured:
                return False
            self.state_keys, self.state_dicts = list(state.keys()), list(state.values())
            self.state_lengths = list(map(len, self.state_dicts))
        if self.tensor_values_only:
            # One pass: each per-parameter dict as long as captured, and their chained values
            # the very objects captured. An entry added, removed or replaced anywhere shows.
            if not tensor_passes.same_dict_contents(self.state_dicts, self.state_lengths, self.state_values):
                return False
        else:
            if list(map(len, self.state_dicts)) != self.state_lengths:
                return False
            values = list(_chain(map(dict.values, self.state_dicts)))
            if list(map(type, values)) != self.state_types or not _same(self.pick_state_tensors(values), self.state_tensors):
                return False
        if not tensor_passes.same_dict_contents(self.model_dicts, self.model_lengths, self.model_values):
            return False
        for partial in self.partial_buffers:
            if tuple(partial.buffers) != partial.names or not _same(partial.pick(list(partial.buffers.values())), partial.persistent):
                return False
        if not self.param_ptrs.unchanged(self.plain_params):
            return False
        return _same(map(operator.attrgetter("_local_tensor"), self.dtensors), self.local_shards)
