"""The snapshot's tensors as views of a host slot, made once per slot and plan and reused by every persist.

Runs in the writer process. A persist sees its slot's bytes as one tensor per entry of its
plan (``hostbuf.exact_view``: a storage of exactly the tensor's bytes, which DCP writes in
place). The views depend only on the slot's mapping and the plan's offsets, not on the
bytes, so they are made the first time and kept: 40,000 views took 0.3 s of every
persist on the 2-core VM. They are dropped with their slot (a released buffer's mapping
must go) or their plan.
"""

from __future__ import annotations

import torch

from .. import protocol as p
from ..hostbuf import exact_view


class SlotViews:
    """Views of each slot, for the plan its last persist used, while both last."""

    def __init__(self) -> None:
        self._made: dict[tuple[int, int], tuple[torch.Tensor, list[torch.Tensor]]] = {}

    def of(self, buffer_id: int, slot: torch.Tensor, plan: p.SetPlanRequest) -> list[torch.Tensor]:
        """``plan``'s tensors in ``slot`` (a new list each call; the tensors are shared)."""
        key = (buffer_id, plan.plan_id)
        made = self._made.get(key)
        if made is None or made[0] is not slot:  # first use, or the id names another mapping now
            # One plan's views per slot: a new plan (another layout or window) replaces the old one's,
            # whose ids are never sent again.
            self.forget_buffer(buffer_id)
            made = (slot, [exact_view(slot, off, e.dtype, e.shape) for e, off in zip(plan.entries, plan.offsets)])
            self._made[key] = made
        return list(made[1])

    def forget_buffer(self, buffer_id: int) -> None:
        """The slot is released: its views must not keep its mapping alive."""
        for key in [k for k in self._made if k[0] == buffer_id]:
            del self._made[key]

    def forget_plan(self, plan_id: int) -> None:
        for key in [k for k in self._made if k[1] == plan_id]:
            del self._made[key]
