"""One optimizer step on the CPU, each param group by the arithmetic its training device used.

Replay rolls state forward on the CPU with the training's own optimizer class and flags
(``writer/replay.py``). Where a group stepped on a GPU, the CPU's kernels round differently
from CUDA's: each group is stepped instead by the emulation the training side measured to
match its device (``train/consistency/replay_arithmetic.py``), named per group:

- a fused Adam / AdamW group by ``fused_adam_math`` (``cuda-fp32-fma``, ``cuda-fp32-fma-l2-rounded``);
- a foreach one by ``foreach_adam_math`` (``cuda-foreach-fp32-fma``; capturable:
  ``cuda-foreach-capturable-fp32-fma``);
- any other group (None) by ``optimizer.step()``, the CPU's own kernel for the group's flags.

Where a kernel computes its bias corrections on the device (fused, capturable), the powers
are the device's own, from the tables the training side computed there (``beta_powers.py``).
The measurement's candidates are stepped by this same code, so what the probe verified is
what the writer runs. Shared by the training side and the writer: imports neither.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .adam_step_arguments import AdamGroupTensors, AdamHyperparameters
from .beta_powers import BetaPowerTables
from .float32_math import EMULATED_DTYPES
from .foreach_adam_math import CUDA_FOREACH_CAPTURABLE_FP32_FMA, CUDA_FOREACH_FP32_FMA, step_like_cuda_foreach_adam
from .fused_adam_math import ARITHMETICS as FUSED_ARITHMETICS
from .fused_adam_math import decouples_weight_decay, step_like_cuda_fused_adam, torch_fused_adam_class

FUSED = "fused"
FOREACH = "foreach"
FOREACH_CAPTURABLE = "foreach-capturable"
FOR_LOOP = "for-loop"
OWN_STEP = "own-step"
# Each emulation, by the name a replay log and a manifest give it, and the path it emulates.
EMULATIONS: dict[str, str] = {
    **{name: FUSED for name in FUSED_ARITHMETICS}, CUDA_FOREACH_FP32_FMA: FOREACH, CUDA_FOREACH_CAPTURABLE_FP32_FMA: FOREACH_CAPTURABLE,
}
# The paths whose kernels compute the bias corrections' powers on the device: replay takes the device's table.
DEVICE_POWER_PATHS = (FUSED, FOREACH_CAPTURABLE)


def replay_hyperparameters(h: dict[str, Any]) -> dict[str, Any]:
    """A logged step's hyperparameters as the CPU replay's optimizer takes them."""
    # param_names names the whole group's parameters; a copy group replays some of them.
    out = {k: v for k, v in h.items() if k not in ("param_names", "params")}
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


def check_arithmetic_names(arithmetics: Sequence[str | None]) -> None:
    unknown = sorted({a for a in arithmetics if a is not None and a not in EMULATIONS})
    if unknown:
        raise ValueError(f"the replay log names the arithmetic {unknown[0]!r}, not one of {sorted(EMULATIONS)}: "
                         "the training side and the writer run different overlapckpt versions; run one version")


def step_like_the_device(
    optimizer: torch.optim.Optimizer, arithmetics: Sequence[str | None], powers: BetaPowerTables | None = None
) -> None:
    """One step of ``optimizer``: param group ``i`` by the emulation ``arithmetics[i]`` names, or by ``optimizer.step()`` (None).

    ``powers``: the device's ``pow(beta, k)`` tables, for the emulations whose kernels take them.

    Only torch's own Adam / AdamW step is emulated: a subclass's ``step()`` runs as it is, and
    float64 tensors, which CUDA computes in double as the CPU does, stay with the optimizer's
    own kernel. The emulated parameters' gradients are hidden from ``optimizer.step()``, which
    then steps every other parameter, and are restored.
    """
    check_arithmetic_names(arithmetics)
    if len(arithmetics) != len(optimizer.param_groups):
        raise ValueError(f"{len(arithmetics)} arithmetics for {len(optimizer.param_groups)} param groups")
    if torch_fused_adam_class(type(optimizer)) is None or all(a is None for a in arithmetics):
        optimizer.step()
        return
    emulated = [
        [p for p in pg["params"] if p.grad is not None and p.dtype in EMULATED_DTYPES] if arithmetic is not None else []
        for pg, arithmetic in zip(optimizer.param_groups, arithmetics)
    ]
    held = {id(p): p.grad for params in emulated for p in params}
    for params in emulated:
        for p in params:
            p.grad = None
    if any(p.grad is not None for pg in optimizer.param_groups for p in pg["params"]):
        optimizer.step()
    for pg, arithmetic, stepped in zip(optimizer.param_groups, arithmetics, emulated):
        for p in stepped:
            p.grad = held[id(p)]
            _init_state_as_torch_does(optimizer.state[p], p, pg)
        if stepped and arithmetic is not None:
            _step_group(optimizer, pg, stepped, arithmetic, powers)


def _init_state_as_torch_does(state: dict[str, Any], p: torch.Tensor, pg: dict[str, Any]) -> None:
    """As torch.optim.Adam's ``_init_group`` for a CPU group (the step count a float32 scalar on the CPU)."""
    if state:
        return
    state["step"] = torch.zeros((), dtype=torch.float32)
    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    if pg["amsgrad"]:
        state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _step_group(
    optimizer: torch.optim.Optimizer, pg: dict[str, Any], stepped: list[torch.Tensor], arithmetic: str, powers: BetaPowerTables | None
) -> None:
    states = [optimizer.state[p] for p in stepped]
    beta1, beta2 = pg["betas"]
    tensors = AdamGroupTensors(
        params=stepped,
        grads=[p.grad for p in stepped],  # type: ignore[misc]  # every stepped parameter has a gradient
        exp_avgs=[s["exp_avg"] for s in states], exp_avg_sqs=[s["exp_avg_sq"] for s in states],
        max_exp_avg_sqs=[s["max_exp_avg_sq"] for s in states] if pg["amsgrad"] else None, state_steps=[s["step"] for s in states],
    )
    decoupled = decouples_weight_decay(pg, type(optimizer))
    if EMULATIONS[arithmetic] == FUSED:
        hyperparameters = AdamHyperparameters(
            lr=pg["lr"], beta1=beta1, beta2=beta2, weight_decay=pg["weight_decay"], eps=pg["eps"], maximize=pg["maximize"],
            decoupled_weight_decay=decoupled,
        )
        step_like_cuda_fused_adam(tensors, hyperparameters, arithmetic=arithmetic, powers=powers)
    else:
        # Python numbers: torch refuses a tensor lr on the foreach path without capturable (and the
        # probe measures a capturable group only with Python numbers).
        hyperparameters = AdamHyperparameters(
            lr=float(pg["lr"]), beta1=float(beta1), beta2=float(beta2), weight_decay=float(pg["weight_decay"]), eps=float(pg["eps"]),
            maximize=pg["maximize"], decoupled_weight_decay=decoupled,
        )
        step_like_cuda_foreach_adam(tensors, hyperparameters, capturable=EMULATIONS[arithmetic] == FOREACH_CAPTURABLE, powers=powers)
