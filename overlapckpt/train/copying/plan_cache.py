"""The layout of the live state and its copy plans, rebuilt only when the state changes.

Building a layout walks every tensor (``get_model_state_dict``, the optimizer's
state), and a plan partitions it; both are deterministic, so they are computed once
and reused while the live tensors are the same ones (``live_identity.py``: identities
and data pointers, no data): the lesson of DCP's plan caching. Each plan is registered with the writer once,
under a plan id that names the (layout, window) pair.
"""

from __future__ import annotations

import torch
from torch import nn

from ... import protocol as p
from ..writer_client.client import WriterClient
from ..writer_client.link import WriterLink
from .layout import CheckpointScope, StateLayout, build_layout
from .plan import CopyPlan, make_plan
from .replay_tables import replay_tables


class PlanCache:
    """The current layout, its plans by window, and the plan ids the writer knows."""

    def __init__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, link: WriterLink, scope: CheckpointScope, key_layout: str
    ) -> None:
        self.model = model
        self.key_layout = key_layout
        self.scope = scope
        self.optimizer = optimizer
        self.link = link
        link.on_replaced(self._hand_to)
        self._layout: StateLayout | None = None
        self._plans: dict[int, CopyPlan] = {}
        self._tables: dict[int, p.ReplayTables] = {}  # by window, for the current layout
        self._plan_ids: dict[int, int] = {}  # by window, for the current layout
        self._next_plan_id = 0

    def layout(self) -> StateLayout:
        """The layout of the live state; rebuilt (and its plans dropped) when a tensor was replaced."""
        current = self._layout
        if current is None or current.identity is None or not current.identity.matches():
            current = self._layout = build_layout(self.model, self.optimizer, self.scope, self.key_layout)
            self._plans = {}
            self._tables = {}
            self._plan_ids = {}
        return current

    def _hand_to(self, writer: WriterClient) -> None:
        """A new writer replaced a dead one: register the current plans with it again, under the same ids."""
        if self._layout is not None:
            for window, plan_id in self._plan_ids.items():
                layout, plan = self._layout, self._plans[window]
                writer.send(p.SetPlanRequest(plan_id, layout.entries, plan.offsets, layout.global_shapes, self.tables(layout, plan)))

    def plan(self, layout: StateLayout, window_steps: int) -> CopyPlan:
        """The plan for ``window_steps`` over ``layout``, which must be the current layout."""
        if window_steps not in self._plans:
            self._plans[window_steps] = make_plan(layout.entries, window_steps, layout.fingerprint)
        return self._plans[window_steps]

    def tables(self, layout: StateLayout, plan: CopyPlan) -> p.ReplayTables | None:
        """The replay tables of ``plan`` (None for window 1), computed once per layout and window."""
        if plan.window_steps < 2:
            return None
        if plan.window_steps not in self._tables:
            self._tables[plan.window_steps] = replay_tables(plan, layout)
        return self._tables[plan.window_steps]

    def registered(self, layout: StateLayout, window_steps: int) -> tuple[CopyPlan, int]:
        """The plan and its id, registered with the writer on first use."""
        plan = self.plan(layout, window_steps)
        if window_steps not in self._plan_ids:
            self._next_plan_id += 1
            self._plan_ids[window_steps] = self._next_plan_id
            self.link.writer.send(
                p.SetPlanRequest(self._next_plan_id, layout.entries, plan.offsets, layout.global_shapes, self.tables(layout, plan))
            )
        return plan, self._plan_ids[window_steps]
