"""Writer side of replay mode: roll each copy group forward to the snapshot's version on the CPU.

Group j was copied at version v_j and the window logged, for every later step t,
the gradients the optimizer consumed and that step's hyperparameters. For each
group, an optimizer of the training's own class is built over the group's host
tensors (parameters and state, in place in the shared slot) with the training's
own flags (foreach, fused, single-tensor), and stepped once per logged step t > v_j.
Steps the loop skipped (GradScaler on inf) never ran a hook, so they are not in
the log and are not replayed. On CPU training this reproduces the state bit for bit.

A fused Adam / AdamW that stepped on a GPU ran CUDA's fused kernel, whose roundings the
CPU's fused kernel does not share (``fused_adam_math.py``): where the training side measured
that the device computes as ``fused_adam_math`` does (the log's ``fused_arithmetic``), those
groups are stepped by it instead, and every other group by the optimizer itself.
"""

from __future__ import annotations

from typing import Any

import torch

from ..format.entries import ROLE_OPTIM, ROLE_PARAM, TensorEntry
from ..fused_adam_math import ARITHMETICS, EMULATED_DTYPES, decouples_weight_decay, step_like_cuda_fused_adam, torch_fused_adam_class
from ..hostbuf import view_bytes
from ..protocol import ReplayLog, ReplayTables
from ..qualname import import_qualified


def _import(spec: tuple[str, str]) -> Any:
    return import_qualified(*spec)


def replay_hyperparameters(h: dict[str, Any]) -> dict[str, Any]:
    """A logged step's hyperparameters as the CPU replay's optimizer takes them."""
    # param_names names the whole group's parameters; a copy group replays some of them.
    out = {k: v for k, v in h.items() if k != "param_names"}
    # The replay runs on CPU tensors; capturable only changes where the step count
    # lives (a device tensor for CUDA graphs), not the arithmetic.
    if out.get("capturable"):
        out["capturable"] = False
        # torch refuses a tensor lr (or betas) with foreach unless capturable; the
        # single-tensor path computes the same update with it.
        tensors = [out.get("lr"), *(out.get("betas") or ())]
        if out.get("foreach") and any(isinstance(v, torch.Tensor) for v in tensors):
            out["foreach"] = False
    return out


def replay_to_version(
    entries: list[TensorEntry], tensors: list[torch.Tensor], log: ReplayLog, tables: ReplayTables, grad_buffer: torch.Tensor
) -> None:
    """Apply the logged steps to each group's tensors in place."""
    optimizer_cls = _import(log.optimizer_class)
    params: dict[str, torch.Tensor] = {}
    state: dict[str, dict[str, torch.Tensor]] = {}
    for e, t in zip(entries, tensors):
        if e.role == ROLE_PARAM and e.param_fqn is not None:
            params[e.param_fqn] = t
        elif e.role == ROLE_OPTIM and e.param_fqn is not None:
            state.setdefault(e.param_fqn, {})[e.path[-1]] = t
    for group_index, version in enumerate(log.group_versions):
        if version is None:
            continue
        steps = [s for s in log.steps if s.step > version and group_index in s.groups]
        fqns = [fqn for fqn, j in tables.copy_group_of.items() if j == group_index]
        if steps and fqns:
            _replay_group(optimizer_cls, log, tables, fqns, params, state, steps, grad_buffer)


def _replay_group(
    optimizer_cls: type,
    log: ReplayLog,
    tables: ReplayTables,
    fqns: list[str],
    params: dict[str, torch.Tensor],
    state: dict[str, dict[str, torch.Tensor]],
    steps: list[Any],
    grad_buffer: torch.Tensor,
) -> None:
    groups_fqns: dict[int, list[str]] = {}
    for fqn in fqns:
        groups_fqns.setdefault(tables.param_group_of[fqn], []).append(fqn)
    first = steps[0]
    param_groups = [
        {**replay_hyperparameters(first.hyperparameters[g]), "params": [params[f] for f in names]}
        for g, names in sorted(groups_fqns.items())
    ]
    optimizer = optimizer_cls(param_groups)
    for fqn in fqns:
        if fqn in state:
            optimizer.state[params[fqn]] = dict(state[fqn])
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
        if log.fused_arithmetic is None:
            optimizer.step()
        else:
            _step_fused_groups_like_the_device(optimizer, log.fused_arithmetic)
    for p in params.values():
        p.grad = None


def _step_fused_groups_like_the_device(optimizer: torch.optim.Optimizer, arithmetic: str) -> None:
    """One step: fused Adam / AdamW groups by CUDA's fused ``arithmetic``, any other group by ``optimizer.step()``."""
    if arithmetic not in ARITHMETICS:
        raise ValueError(f"the replay log names the fused arithmetic {arithmetic!r}, not one of {ARITHMETICS}: "
                         "the training side and the writer run different overlapckpt versions; run one version")
    # Only torch's own fused step is emulated: a subclass's step() runs as it is, and float64 tensors,
    # which CUDA's kernel computes in double as the CPU's does, stay with the optimizer's own kernel.
    if torch_fused_adam_class(type(optimizer)) is None:
        optimizer.step()
        return
    emulated = {
        id(pg): [p for p in pg["params"] if p.grad is not None and p.dtype in EMULATED_DTYPES]
        for pg in optimizer.param_groups if pg.get("fused")
    }
    held = {id(p): p.grad for params in emulated.values() for p in params}
    if not held:
        optimizer.step()
        return
    for params in emulated.values():  # hidden from optimizer.step(), which then steps every other parameter
        for p in params:
            p.grad = None
    if any(p.grad is not None for pg in optimizer.param_groups for p in pg["params"]):
        optimizer.step()
    for pg in optimizer.param_groups:
        stepped = emulated.get(id(pg), [])
        for p in stepped:
            p.grad = held[id(p)]
            state = optimizer.state[p]
            if not state:  # as torch.optim.Adam's _init_group for a fused group
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if pg["amsgrad"]:
                    state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if not stepped:
            continue
        states = [optimizer.state[p] for p in stepped]
        beta1, beta2 = pg["betas"]
        step_like_cuda_fused_adam(
            stepped, [p.grad for p in stepped], [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
            [s["max_exp_avg_sq"] for s in states] if pg["amsgrad"] else None, [s["step"] for s in states],
            lr=pg["lr"], beta1=beta1, beta2=beta2, weight_decay=pg["weight_decay"], eps=pg["eps"], maximize=pg["maximize"],
            decoupled_weight_decay=decouples_weight_decay(pg, type(optimizer)),
            arithmetic=arithmetic,
        )
