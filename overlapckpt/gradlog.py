"""Training side of replay mode: log the gradients and hyperparameters of each window step.

For a snapshot requested at step s with window W, group j is copied after step
s+j. Before each step t in s+1 .. V, the pre-hook copies (on the side stream) the
gradients of the groups already copied, exactly as the optimizer is about to
consume them (after unscaling and clipping), and records that step's
hyperparameters. The writer replays those steps on the CPU (``replay.py``).

Host memory: the gradients are kept until the whole window has landed and the
writer replays in one batch, so the extra host memory is every gradient the
window waits for: for groups of equal size, (W-1)/2 times the parameter bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .plan import ENTRY_ALIGN_BYTES, CopyPlan
from .state import StateLayout

# Optimizers whose update is elementwise per tensor, so a subset of parameters can be
# stepped on its own and the result is the same as inside the full step.
REPLAYABLE_OPTIMIZERS = frozenset(
    {"SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Adadelta", "Adamax", "NAdam", "RAdam", "ASGD", "Rprop", "Adafactor"}
)


@dataclass
class GradientStep:
    """What one optimizer step inside the window consumed."""

    step: int
    groups: list[int]  # copy groups whose gradients were logged
    hyperparameters: list[dict[str, Any]]  # per param_group, without "params"
    grad_none: list[str]  # FQNs of logged parameters that had no gradient (the optimizer skipped them)


@dataclass
class ReplayLog:
    """Everything the writer needs to roll each group forward to the target version."""

    optimizer_class: tuple[str, str]
    grad_slot_id: int
    grad_offsets: dict[tuple[int, str], int]  # (window step index i, fqn) -> offset in the grad buffer
    param_group_of: dict[str, int]  # fqn -> index of its param_group
    copy_group_of: dict[str, int]  # fqn -> index of the copy group that holds it
    base_step: int  # the step s at which the snapshot was requested
    group_versions: list[int | None] = field(default_factory=list)
    steps: list[GradientStep] = field(default_factory=list)
    target_version: int | None = None


def gradient_layout(plan: CopyPlan, layout: StateLayout) -> tuple[dict[tuple[int, str], int], int]:
    """Offsets of every gradient a full window logs: step i (1..W-1) holds groups 0..i-1."""
    shapes = {fqn: p for fqn, p in zip(layout.param_fqns, layout.params)}
    offsets: dict[tuple[int, str], int] = {}
    cursor = 0
    for i in range(1, plan.window_steps):
        for group in plan.groups[:i]:
            for fqn in group.param_fqns:
                p = shapes[fqn]
                offsets[(i, fqn)] = cursor
                nbytes = p.numel() * p.element_size()
                cursor += (nbytes + ENTRY_ALIGN_BYTES - 1) // ENTRY_ALIGN_BYTES * ENTRY_ALIGN_BYTES
    return offsets, max(cursor, ENTRY_ALIGN_BYTES)


def capture_hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each param_group's hyperparameters now (a scheduler may change lr every step)."""
    out = []
    for group in optimizer.param_groups:
        g = {}
        for k, v in group.items():
            if k == "params":
                continue
            g[k] = v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v
        out.append(g)
    return out
