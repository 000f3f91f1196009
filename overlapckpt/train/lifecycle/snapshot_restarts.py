"""When a snapshot cannot reach its version: what notices it, and the restart.

A replay window relies on the optimizer's update being the only write to the state
it copied, on the gradients it logged being the ones consumed, and on the layout it
was planned over staying complete. GradScaler's fused step, a pre-hook that writes
copied state, state created inside the window, and a step that never called the
closure (so its update ran unfenced) each break one of these. The snapshot is then
dropped and its request started again at the next chance, with a warning that says
why; for the first two, replay is off from then on (window 1, or stage).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from ...optimizers import step_owner
from ..consistency.snapshot import Snapshot, SnapshotMode
from ..warnings_text import CLOSURE_IGNORED_WARNING, GRAD_SCALER_WARNING, LATE_HOOK_WARNING, NEW_STATE_WARNING, REPLAY_MUTATION_WARNING

if TYPE_CHECKING:
    from .engine_parts import EngineParts


class SnapshotRestarts:
    """The restart rules: what notices that a snapshot cannot reach its version, and its restart."""

    def __init__(self, parts: EngineParts) -> None:
        self.p = parts
        self.s = parts.state

    def update_point_skipped(self) -> None:
        """The step took our closure and never called it: its update ran without our fences."""
        self.s.warn_once("closure", CLOSURE_IGNORED_WARNING.format(optimizer=type(self.p.optimizer).__qualname__))
        for snap in list(self.s.snapshots):
            if snap.unfenced or (snap.mode == SnapshotMode.REPLAY and snap.version is None):
                self.restart(snap)

    def replay_cannot_follow(self, mutated_by: list[str]) -> None:
        """A pre-hook (or the closure) wrote copied state in place: replay cannot repeat that write."""
        self.p.windows.replay_unfollowable = True
        self.s.warn_once("replay-mutation", REPLAY_MUTATION_WARNING.format(hooks=", ".join(mutated_by) or "the closure"))
        for snap in self.s.open_replay_windows():
            self.restart(snap)

    def note_grad_scaler(self) -> None:
        if self.p.windows.grad_scaler_seen or not hasattr(self.p.optimizer, "found_inf"):
            return
        self.p.windows.grad_scaler_seen = True
        if self.p.consistency == SnapshotMode.REPLAY and self.p.windows.widest_window != 1:
            warnings.warn(GRAD_SCALER_WARNING, stacklevel=4)
            for snap in self.s.open_replay_windows():
                # Its logged gradients came from steps GradScaler's fused kernel
                # unscales and may skip: restart it, now at window 1.
                self.restart(snap)

    def restart_if_state_grew(self) -> None:
        """Post-hook: a replay window whose layout lacks state this step created cannot reach its version."""
        for snap in self.s.open_replay_windows():
            if self.p.gradients.state_grew(snap.layout):
                warnings.warn(NEW_STATE_WARNING.format(old=snap.requested_step, new=self.s.step_count), stacklevel=4)
                self.restart(snap)

    def restart(self, snap: Snapshot) -> None:
        """Replace a replay snapshot that cannot reach its version by one started at the next chance."""
        self.s.snapshots.remove(snap)
        # Its copies may still be queued: the pool unmaps the slot only once they landed.
        self.p.slots.drop(snap.slot, snap.tickets)
        self.p.requests.put_back(snap.requested_step, snap.started_step, snap.ledger.scheduled_version)

    def warn_about_late_hooks(self) -> None:
        """Post-step hooks that run after ours may write tensors our copies are reading."""
        from torch.optim.optimizer import _global_optimizer_post_hooks

        ours = self.p.step_point.post_hook_id
        keys = list(step_owner(self.p.optimizer)._optimizer_step_post_hooks.keys())
        later = len(keys) - 1 - keys.index(ours) if ours in keys else 0
        if later or _global_optimizer_post_hooks:
            self.s.warn_once("late-hook", LATE_HOOK_WARNING.format(count=later + len(_global_optimizer_post_hooks)))
