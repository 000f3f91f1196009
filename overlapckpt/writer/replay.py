"""Writer side of replay mode: roll each copy group forward to the snapshot's version on the CPU.

Group j was copied at version v_j and the window logged, for every later step t,
the gradients the optimizer consumed and that step's hyperparameters. For each
group, an optimizer of the training's own class is built over the group's host
tensors (parameters and state, in place in the shared slot) with the training's
own flags (foreach, fused, single-tensor), and stepped once per logged step t > v_j.
Steps the loop skipped (GradScaler on inf) never ran a hook, so they are not in
the log and are not replayed. On CPU training this reproduces the state bit for bit.

A group that stepped on a GPU ran CUDA's kernels, whose roundings the CPU's do not share:
the training side measures each param group on its device when the Checkpointer is built,
and the log names, per group, the emulation that matched it (``device_adam_step.py``); those
groups are stepped by it, and every other group by the optimizer itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .. import cuda_adam_native
from ..beta_powers import BetaPowerTables
from ..device_adam_step import check_arithmetic_names, replay_hyperparameters, step_like_the_device
from ..format.entries import ROLE_OPTIM, ROLE_PARAM, TensorEntry
from ..hostbuf import view_bytes
from ..protocol import ReplayLog, ReplayTables
from ..qualname import import_qualified


def _import(spec: tuple[str, str]) -> Any:
    return import_qualified(*spec)


def warm_up() -> None:
    """Pay replay's one-time costs at the writer's start (before Ready, in a run that may replay), not in a persist.

    torch.optim's first optimizer imports ``torch._dynamo`` (0.5 to 1 s on a 2-core VM): a first
    replay checkpoint of 1.5 MiB took 425 ms where the later ones took 22
    (benchmarks/results/small-checkpoint/before-warm-up.txt). One AdamW step of one element
    here, and the C pass loaded (built on first use), leave the first replay nothing to import.
    """
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([param])
    param.grad = torch.zeros(1)
    optimizer.step()
    cuda_adam_native.library()


def replay_to_version(
    entries: list[TensorEntry], tensors: list[torch.Tensor], log: ReplayLog, tables: ReplayTables, grad_buffer: torch.Tensor
) -> None:
    """Apply the logged steps to each group's tensors in place."""
    arithmetic_names = log.arithmetic_names()
    check_arithmetic_names(arithmetic_names)
    replay = _Replay(
        optimizer_cls=_import(log.optimizer_class), params={}, state={},
        arithmetic_names=arithmetic_names, powers=BetaPowerTables(log.beta_powers),
    )
    for e, t in zip(entries, tensors):  # the slot's parameters and optimizer state, by the FQN their entries name
        if e.role == ROLE_PARAM and e.param_fqn is not None:
            replay.params[e.param_fqn] = t
        elif e.role == ROLE_OPTIM and e.param_fqn is not None:
            replay.state.setdefault(e.param_fqn, {})[e.path[-1]] = t
    for group_index, version in enumerate(log.group_versions):
        if version is None:
            continue
        steps = [s for s in log.steps if s.step > version and group_index in s.groups]
        fqns = [fqn for fqn, j in tables.copy_group_of.items() if j == group_index]
        if steps and fqns:
            _replay_group(replay, log, tables, fqns, steps, grad_buffer)


@dataclass(frozen=True)
class _Replay:
    """What every copy group's replay uses, made once per snapshot: the decoded power tables keep their cache."""

    optimizer_cls: type
    params: dict[str, torch.Tensor]  # the slot's host tensors, stepped in place, by parameter FQN
    state: dict[str, dict[str, torch.Tensor]]  # each parameter's optimizer state, by state name (exp_avg, step, ...)
    arithmetic_names: list[str | None]  # per param group, the arithmetic measured on its device
    powers: BetaPowerTables  # the device's own beta powers, when the log carries them


def _replay_group(
    replay: _Replay, log: ReplayLog, tables: ReplayTables, fqns: list[str], steps: list[Any], grad_buffer: torch.Tensor
) -> None:
    params, state = replay.params, replay.state
    groups_fqns: dict[int, list[str]] = {}
    for fqn in fqns:
        groups_fqns.setdefault(tables.param_group_of[fqn], []).append(fqn)
    first = steps[0]
    param_groups = [
        {**replay_hyperparameters(first.hyperparameters[g]), "params": [params[f] for f in names]}
        for g, names in sorted(groups_fqns.items())
    ]
    optimizer = replay.optimizer_cls(param_groups)
    names_by_group = replay.arithmetic_names
    arithmetics = [names_by_group[g] if g < len(names_by_group) else None for g in sorted(groups_fqns)]
    for fqn in fqns:
        if fqn in state:
            optimizer.state[params[fqn]] = dict(state[fqn])
    try:
        # Each tensor's emulated steps wait and run in one pass over it at the end of the block
        # (cuda_adam_native.steps_deferred): its elements are carried through every step while in
        # cache, so param and moments cross memory once, not once a step. Nothing reads them between steps.
        with cuda_adam_native.steps_deferred():
            _step_through(replay, log, tables, steps, groups_fqns, optimizer, arithmetics, grad_buffer)
    finally:
        # The params are the slot's views, kept for later persists (slot_views.py): no .grad may
        # keep the gradient buffer's mapping alive past its release, a failed replay's included.
        for p in params.values():
            p.grad = None


def _step_through(
    replay: _Replay, log: ReplayLog, tables: ReplayTables, steps: list[Any], groups_fqns: dict[int, list[str]],
    optimizer: torch.optim.Optimizer, arithmetics: list[str | None], grad_buffer: torch.Tensor,
) -> None:
    """Each logged step in turn: the step's hyperparameters and gradients (views of the buffer), then the step."""
    params = replay.params
    for record in steps:
        i = record.step - log.base_step
        for pg, (g, names) in zip(optimizer.param_groups, sorted(groups_fqns.items())):
            for k, v in replay_hyperparameters(record.hyperparameters[g]).items():
                pg[k] = v
            for f in names:
                p = params[f]
                if f in record.grad_none:
                    p.grad = None
                else:
                    p.grad = view_bytes(grad_buffer, tables.grad_offsets[(i, f)], p.dtype, tuple(p.shape))
        step_like_the_device(optimizer, arithmetics, replay.powers)
