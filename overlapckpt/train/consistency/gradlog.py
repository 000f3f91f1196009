"""Training side of replay mode: log the gradients and hyperparameters of each window step.

For a snapshot started at step s with window W, group j is copied after step
s+j. Before each step t in s+1 .. V, the pre-hook copies the gradients of the
groups already copied, exactly as the optimizer is about to consume them (after
unscaling and clipping), and records that step's hyperparameters. The writer
replays those steps on the CPU (``replay.py``).

Two ways to copy a gradient, chosen by the copier (``clone_is_cheap``):

* clone, then drain (CUDA): the pre-hook clones the gradients device-to-device on
  the compute stream (HBM: milliseconds for gigabytes) and the side stream drains
  the clones to the host with no fence at all, since nothing writes a clone. The
  cost is device memory for one step's logged gradients while they drain. Where a
  step's gradients are plain tensors of one dtype (``gradient_layout`` lays them out
  gapless), the clone is one packed tensor made in one call (``Copier.clone_packed``)
  and drained in one copy: no Python per gradient, whatever their count (a
  Mixture-of-Experts rank logs thousands). Otherwise each is cloned on its own.
* copy, then fence (CPU): the copy reads ``.grad`` itself; the compute stream waits
  for it right after the optimizer step (the next iteration may write gradients in
  place), or before the step for an optimizer whose step writes them (SGD's foreach
  Nesterov update).

Host memory: the gradients are kept until the whole window has landed and the
writer replays in one batch, so the extra host memory is every gradient the
window waits for: for groups of equal size, (W-1)/2 times the parameter bytes.
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import InternalError
from ...format.manifest_records import GroupArithmetic
from ...optimizers import OptimizerGroup, describe_optimizer, update_rule_class
from ...protocol import GradientStep, ReplayLog
from ..copying.layout import StateLayout, optimizer_shape_signature
from ..copying.ownership import is_dtensor, local_tensor
from ..copying.plan import CopyPlan
from ..copying.replay_tables import gradient_layout
from ..copying.slots import HostSlot
from ..copying.tensor_passes import grads_of
from ..copying.transfer import Copier, CopyTicket, copy_values_to_host
from .replay_arithmetic import group_arithmetics


def capture_hyperparameters(
    optimizer: torch.optim.Optimizer, copier: Copier
) -> tuple[list[dict[str, Any]], CopyTicket | None]:
    """Each param_group's hyperparameters now (a scheduler may change lr every step).

    Tensor values (a tensor lr, betas) become host copies that are valid once the
    returned ticket has landed: copying a device tensor with ``.to("cpu")`` would
    synchronize the host inside the hook.
    """
    groups = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    where = [(gi, k) for gi, g in enumerate(groups) for k, v in g.items() if isinstance(v, torch.Tensor)]
    if not where:
        return groups, None
    host, ticket = copy_values_to_host(copier, [groups[gi][k] for gi, k in where])
    for (gi, k), h in zip(where, host):
        groups[gi][k] = h
    return groups, ticket


@dataclass(eq=False)
class _LogTargets:
    """What one window step logs: its parameters in order, and their views in the gradient buffer."""

    fqns: list[str]
    params: list[torch.Tensor]
    destinations: list[torch.Tensor]
    all_plain: bool  # no DTensor among them: a gradient is its own local part
    # The destinations as one gapless run of the gradient buffer, where they are one (every
    # parameter plain, device-resident and of one dtype): a packed clone drains into it in one copy.
    packed_run: torch.Tensor | None = None


@dataclass
class LoggedGradients:
    """One step's gradient copy, and the fence it needs (the engine places fences)."""

    tickets: list[CopyTicket]
    fence_before_step: CopyTicket | None = None  # the step writes the gradients the copy reads
    fence_after_step: CopyTicket | None = None  # the next iteration may write them in place


class GradientLogger:
    """Copies, for each replay window step, the gradients and hyperparameters the step consumes."""

    def __init__(self, optimizer: torch.optim.Optimizer, copier: Copier) -> None:
        self.optimizer = optimizer
        self.copier = copier
        # Gradient views into a slot's gradient buffer, per (buffer id, layout fingerprint, window).
        self._views: dict[tuple[int, int, int], tuple[dict[tuple[int, str], int], dict[tuple[int, str], torch.Tensor]]] = {}
        self._targets_by_key: dict[tuple[int, ...], _LogTargets] = {}
        self._arithmetics: list[GroupArithmetic] | None = None
        self._beta_powers: dict[int, bytes] = {}

    def prepare(self) -> None:
        """Measure how the CPU replays each param group's steps on its device (a sync: call it outside any step).

        Again where groups were added since (``add_param_group``): each configuration is measured once per process.
        """
        if self._arithmetics is None or len(self._arithmetics) != len(self.optimizer.param_groups):
            rule = update_rule_class(self.optimizer)
            if rule is None:
                self._arithmetics = []
            else:
                self._arithmetics, powers = group_arithmetics(rule, list(self.optimizer.param_groups))
                self._beta_powers = powers.tables

    def open(self, slot: HostSlot, plan: CopyPlan, layout: StateLayout, base_step: int) -> ReplayLog:
        """The replay log of a snapshot started at ``base_step``, writing into ``slot``'s gradient buffer."""
        self._slot_views(slot, plan, layout)
        rule = update_rule_class(self.optimizer)
        if rule is None:  # options.check_optimizer_for_mode refuses replay for such a group
            raise InternalError(f"replay of {describe_optimizer(self.optimizer)}: its optimizers differ")
        self.prepare()  # measured once, when the Checkpointer was built (replay mode), else here
        return ReplayLog(
            optimizer_class=(rule.__module__, rule.__qualname__),
            grad_buffer_id=slot.grad_buffer_id,  # type: ignore[arg-type]
            base_step=base_step,
            group_versions=[None] * len(plan.groups),
            group_arithmetics=list(self._arithmetics or []),
            beta_powers=self._beta_powers,
        )

    def _slot_views(
        self, slot: HostSlot, plan: CopyPlan, layout: StateLayout
    ) -> tuple[dict[tuple[int, str], int], dict[tuple[int, str], torch.Tensor]]:
        key = (int(slot.grad_buffer_id or 0), plan.fingerprint, plan.window_steps)
        if key not in self._views:
            if slot.grad_buffer is None:
                raise InternalError("replay needs the slot's gradient buffer; the slot pool did not allocate it")
            offsets, _ = gradient_layout(plan, layout)
            by_fqn = dict(zip(layout.param_fqns, layout.param_locals))
            views = {
                k: slot.grad_buffer.view(off, by_fqn[k[1]].dtype, tuple(by_fqn[k[1]].shape)) for k, off in offsets.items()
            }
            self._views = {k: v for k, v in self._views.items() if k[0] != key[0]}  # older plans of this buffer
            self._views[key] = (offsets, views)
        return self._views[key]

    def log(
        self, log: ReplayLog, slot: HostSlot, plan: CopyPlan, layout: StateLayout, copied_groups: int, step: int
    ) -> LoggedGradients | None:
        """Pre-hook of ``step`` inside the window: copy the gradients it will consume of the groups copied so far."""
        i = step - log.base_step
        if i < 1 or copied_groups == 0:
            return None
        targets = self._targets(slot, plan, layout, i, copied_groups)
        # .grad is read every step: zero_grad(set_to_none=True) gives each backward new gradient tensors.
        grads: list[Any] = grads_of(targets.params)
        if any(map(operator.is_, grads, itertools.repeat(None))):  # by identity: == on a tensor is Python
            none = [f for f, g in zip(targets.fqns, grads) if g is None]
            sources = [local_tensor(g) for g in grads if g is not None]
            destinations = [d for d, g in zip(targets.destinations, grads) if g is not None]
        else:
            none = []
            sources = grads if targets.all_plain else [local_tensor(g) for g in grads]
            destinations = targets.destinations
        hyperparameters, hp_ticket = capture_hyperparameters(self.optimizer, self.copier)
        log.steps.append(
            GradientStep(step=step, groups=list(range(copied_groups)), hyperparameters=hyperparameters, grad_none=none)
        )
        out = LoggedGradients(tickets=[hp_ticket] if hp_ticket is not None else [])
        if self.copier.clone_is_cheap and targets.packed_run is not None and not none:
            # Every gradient cloned into one allocation in one call, drained in one copy: no
            # work per tensor, whatever the count (a Mixture-of-Experts rank logs thousands).
            # Cloned on the compute stream before the step, as below: no fence.
            run = targets.packed_run
            packed = self.copier.clone_packed(sources, run.dtype, run.numel())
            route = slot.route(self.copier, ("gradients-packed", slot.grad_buffer_id, i, copied_groups), [packed], [run])
            out.tickets.append(self.copier.copy_async([packed], [run], keepalive=[packed], route=route))
            return out
        # Made on the first step that logs into these views; the sources are each step's gradients.
        route = slot.route(self.copier, ("gradients", slot.grad_buffer_id, i, copied_groups, tuple(none)), sources, destinations)
        if self.copier.clone_is_cheap:
            # Cloned on the compute stream before the step: exactly what the step
            # consumes; no later kernel writes a clone, so its drain needs no fence.
            clones = self.copier.stage(sources)
            out.tickets.append(self.copier.copy_async(clones, destinations, keepalive=clones, route=route))
            return out
        ticket = self.copier.copy_async(sources, destinations, route=route)
        out.tickets.append(ticket)
        if step_writes_gradients(self.optimizer):
            out.fence_before_step = ticket
        else:
            out.fence_after_step = ticket
        return out

    def _targets(self, slot: HostSlot, plan: CopyPlan, layout: StateLayout, i: int, copied_groups: int) -> _LogTargets:
        """The parameters step ``i`` logs and their views, gathered once per slot buffer, plan, step and group count."""
        key = (int(slot.grad_buffer_id or 0), plan.fingerprint, plan.window_steps, i, copied_groups)
        targets = self._targets_by_key.get(key)
        if targets is None:
            offsets, views = self._slot_views(slot, plan, layout)
            by_fqn = dict(zip(layout.param_fqns, layout.params))
            fqns = [fqn for group in plan.groups[:copied_groups] for fqn in group.param_fqns]
            params = [by_fqn[f] for f in fqns]
            targets = _LogTargets(fqns, params, [views[(i, f)] for f in fqns], not any(map(is_dtensor, params)))
            targets.packed_run = self._packed_run(slot, targets, [offsets[(i, f)] for f in fqns])
            self._targets_by_key = {k: v for k, v in self._targets_by_key.items() if k[0] != key[0] or k[:3] == key[:3]}  # this buffer's older plans go
            self._targets_by_key[key] = targets
        return targets

    def _packed_run(self, slot: HostSlot, targets: _LogTargets, offsets: list[int]) -> torch.Tensor | None:
        """The gradient buffer's bytes from the first destination to the last, as one tensor of their
        dtype, where the destinations lie there one after another in order (``gradient_layout``
        makes a step's gradients of one dtype so) and a packed clone can fill them: else None."""
        params = targets.params
        if not params or not targets.all_plain or slot.grad_buffer is None:
            return None
        dtype = params[0].dtype
        if any(p.dtype != dtype or not self.copier.is_device_resident(p) for p in params):
            return None
        itemsize = params[0].element_size()
        ends = [off + p.numel() * itemsize for off, p in zip(offsets, params)]
        if offsets[1:] != ends[:-1]:
            return None
        return slot.grad_buffer.view(offsets[0], dtype, ((ends[-1] - offsets[0]) // itemsize,))

    def release(self) -> None:
        """Drop the views into gradient buffers, so releasing a buffer unmaps it."""
        self._views = {}
        self._targets_by_key = {}

    def state_grew(self, layout: StateLayout) -> bool:
        """The optimizer gained state or parameters that ``layout`` lacks (a parameter unfrozen)."""
        return optimizer_shape_signature(self.optimizer) != layout.shape_signature


def step_writes_gradients(optimizer: Any) -> bool:
    """Whether this optimizer's step writes ``.grad`` in place (found by reading torch.optim)."""
    if isinstance(optimizer, OptimizerGroup):
        return any(step_writes_gradients(o) for o in optimizer.optimizers)
    return isinstance(optimizer, torch.optim.SGD) and any(
        g.get("nesterov") and g.get("momentum") and g.get("foreach") is not False for g in optimizer.param_groups
    )
