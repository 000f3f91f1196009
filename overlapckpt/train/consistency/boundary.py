"""Capture what is not a tracked tensor, at the iteration boundary of a snapshot's version.

The boundary state is the optimizer's ``param_groups`` and non-tensor state entries,
the stateful objects (schedulers, samplers) and the RNG states. It is captured in a
hook (``ckpt.step()`` or the post-hook), so it must not synchronize the host:

* tensor values (a tensor lr, GradScaler's scale and growth tracker) travel through
  the copier and are read only once their ticket has landed (``resolve_boundary``,
  called when the snapshot is sent);
* ``GradScaler.state_dict()`` calls ``.item()`` twice, so a GradScaler is read from
  its fields instead, giving the same dict.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from ..copying.layout import StateLayout
from ..copying.transfer import Copier, CopyTicket, copy_values_to_host
from .snapshot import BoundaryState


@dataclass(frozen=True)
class _HostValue:
    """A host copy of a device tensor, valid once its ticket landed; ``kind`` converts it (float, int, or None: a tensor)."""

    tensor: torch.Tensor
    kind: type | None


def _grad_scaler_state(scaler: Any, copier: Copier) -> tuple[dict[str, Any], CopyTicket | None]:
    """``scaler.state_dict()`` without its two ``.item()`` host synchronizations."""
    if not scaler.is_enabled():
        return {}, None
    scale, tracker = getattr(scaler, "_scale", None), getattr(scaler, "_growth_tracker", None)
    state: dict[str, Any] = {
        "scale": scaler._init_scale,
        "growth_factor": scaler._growth_factor,
        "backoff_factor": scaler._backoff_factor,
        "growth_interval": scaler._growth_interval,
        "_growth_tracker": scaler._init_growth_tracker,
    }
    if scale is None or tracker is None:
        return state, None  # no step scaled yet: the initial values, as state_dict() gives
    (scale_host, tracker_host), ticket = copy_values_to_host(copier, [scale, tracker])
    state["scale"] = _HostValue(scale_host, float)
    state["_growth_tracker"] = _HostValue(tracker_host, int)
    return state, ticket


def _is_grad_scaler(obj: Any) -> bool:
    scaler_type = getattr(getattr(torch, "amp", None), "GradScaler", None)
    return scaler_type is not None and isinstance(obj, scaler_type)


def _defer_tensors(value: Any, copier: Copier, tickets: list[CopyTicket]) -> Any:
    """Deep-copy ``value``, replacing device tensors by host copies that land with a ticket."""
    if isinstance(value, torch.Tensor):
        if not copier.is_device_resident(value) or (copier.device is not None and copier.device.host_is_the_device):
            # On the host, or on a CPU device whose training stream is this thread: its value now, with no
            # ticket to wait for (a pipelined persist sends the request before the side stream reaches it).
            return value.detach().clone()
        (host,), ticket = copy_values_to_host(copier, [value])
        if ticket is not None:
            tickets.append(ticket)
        return _HostValue(host, None)
    if isinstance(value, dict):
        return {k: _defer_tensors(v, copier, tickets) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_defer_tensors(v, copier, tickets) for v in value]
        return items if isinstance(value, list) else tuple(items)
    return copy.deepcopy(value)


def capture_boundary(
    layout: StateLayout, optimizer: torch.optim.Optimizer, stateful: dict[str, Any], copier: Copier
) -> tuple[BoundaryState, list[CopyTicket]]:
    """The boundary state now, and the tickets its device values arrive with."""
    tickets: list[CopyTicket] = []
    groups = []
    for group, fqns in zip(optimizer.param_groups, layout.group_param_fqns):
        g = {k: _defer_tensors(v, copier, tickets) for k, v in group.items() if k != "params"}
        g["params"] = list(fqns)
        groups.append(g)
    scalars: dict[str, Any] = {}
    if layout.small_optim_keys:
        # Only then: a map of every parameter costs milliseconds at tens of thousands of them,
        # twice per snapshot, and Adam's state has no small keys (its step counters are tensors).
        by_fqn = dict(zip(layout.param_fqns, layout.params))
        scalars = {
            f"{fqn}\x00{k}": _defer_tensors(optimizer.state[by_fqn[fqn]][k], copier, tickets)
            for fqn, k in layout.small_optim_keys
        }
    objects: dict[str, Any] = {}
    for name, obj in stateful.items():
        if _is_grad_scaler(obj):
            objects[name], ticket = _grad_scaler_state(obj, copier)
            if ticket is not None:
                tickets.append(ticket)
        else:
            objects[name] = _defer_tensors(obj.state_dict(), copier, tickets)
    rng: dict[str, Any] = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # The generators' seeds and offsets live on the host: no device sync.
        rng["torch_cuda"] = torch.cuda.get_rng_state_all()
    return BoundaryState(param_groups=groups, optimizer_scalars=scalars, stateful=objects, rng=rng), tickets


def resolve_values(value: Any) -> Any:
    """Replace host copies by their values; call only once their tickets have landed."""
    if isinstance(value, _HostValue):
        if value.kind is None:
            return value.tensor
        return value.kind(value.tensor.item())  # a host tensor: no device sync
    if isinstance(value, dict):
        return {k: resolve_values(v) for k, v in value.items()}
    if isinstance(value, list):
        return [resolve_values(v) for v in value]
    if isinstance(value, tuple):
        return tuple(resolve_values(v) for v in value)
    return value


def resolve_boundary(boundary: BoundaryState) -> tuple[dict[str, Any], dict[str, Any]]:
    """(optimizer small state, extra state) as the writer stores them."""
    small_state = {
        # "params" are the FQNs listed at capture (strings, thousands of them): nothing in them to resolve.
        "param_groups": [{k: v if k == "params" else resolve_values(v) for k, v in g.items()} for g in boundary.param_groups],
        "small_optim": resolve_values(boundary.optimizer_scalars),
    }
    extra_state = {"stateful": resolve_values(boundary.stateful), "rng": boundary.rng}
    return small_state, extra_state
