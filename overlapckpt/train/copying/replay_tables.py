"""The tables a replay window's plan implies: where each logged gradient lies, and which groups hold which parameter.

They are pure functions of the plan and its layout, so they are computed once per plan
(``PlanCache``) and registered with the writer along with it, instead of being built
and sent with every snapshot: at 30,000 state tensors, pickling them cost 8 ms per send.
"""

from __future__ import annotations

from ...protocol import ReplayTables
from .device import align_up
from .layout import StateLayout
from .plan import CopyPlan, align_bytes


def gradient_layout(plan: CopyPlan, layout: StateLayout) -> tuple[dict[tuple[int, str], int], int]:
    """Offsets of every gradient a full window logs: step i (1..W-1) holds groups 0..i-1.

    A step's gradients lie one after another, each aligned to its own element size only
    (a step starts on the entry alignment): gradients of one dtype are then one gapless
    run, which a packed clone (``Copier.clone_packed``) fills in one copy.
    """
    shapes = dict(zip(layout.param_fqns, layout.param_locals))
    offsets: dict[tuple[int, str], int] = {}
    cursor = 0
    for i in range(1, plan.window_steps):
        cursor = align_bytes(cursor)
        for group in plan.groups[:i]:
            for fqn in group.param_fqns:
                p = shapes[fqn]
                cursor = align_up(cursor, p.element_size())
                offsets[(i, fqn)] = cursor
                cursor += p.numel() * p.element_size()
    return offsets, align_bytes(max(cursor, 1))


def replay_tables(plan: CopyPlan, layout: StateLayout) -> ReplayTables:
    offsets, nbytes = gradient_layout(plan, layout)
    return ReplayTables(
        grad_offsets=offsets,
        grad_nbytes=nbytes,
        param_group_of={fqn: gi for gi, fqns in enumerate(layout.group_param_fqns) for fqn in fqns},
        copy_group_of=plan.group_of_param(),
    )
