"""Replay repeats the optimizer's update rule, nothing else: notice when something else writes copied state.

Between our pre-hook and the update point, another pre-hook (or the closure) may
write a parameter or optimizer state in place: a weight projection, an EMA kept in
the optimizer state. Window 1 and stage mode stay exact (the copy was fenced
before that write), but a replay window cannot repeat the write on the CPU. Every
in-place write bumps a tensor's version counter (``Tensor._version``), so the
guard records the counters of the state replay has copied when our pre-hook runs,
and compares them at the update point. It only runs when another pre-hook
follows ours (``StepPoint.others_follow``): that costs one attribute read per
tensor, twice a step, inside replay windows only.

Writes through ``.data`` do not bump the counter and are not seen; the README
says so.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .snapshot import Snapshot, SnapshotMode


class ReplayMutationGuard:
    """Version counters of replay's copied tensors, recorded at our pre-hook, checked at the update point.

    ``other_pre_hook_names`` names the pre-hooks that run after ours (``StepPoint``'s): what a
    changed counter is blamed on.
    """

    def __init__(self, other_pre_hook_names: Callable[[], list[str]]) -> None:
        self.other_pre_hook_names = other_pre_hook_names
        self._recorded: list[tuple[torch.Tensor, int]] = []

    def record(self, snapshots: list[Snapshot]) -> None:
        self._recorded = [
            (t, t._version)
            for snap in snapshots
            if snap.mode == SnapshotMode.REPLAY and snap.version is None
            for group in snap.plan.groups[: snap.next_group]
            for t in (snap.layout.live_tensors[i] for i in group.entry_indices)
        ]

    def mutated(self) -> list[str]:
        """The pre-hooks that may have written copied state since ``record`` ([] if nothing changed)."""
        recorded, self._recorded = self._recorded, []
        if any(t._version != v for t, v in recorded):
            return self.other_pre_hook_names()
        return []
