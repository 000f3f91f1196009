"""The per-checkpoint ledger: which group holds which version, what arrived when.

A snapshot requested at step s with window W and target version V is complete
when every group's bytes have landed and every group is at V: directly (window 1,
stage mode, the last group) or once the writer replays the logged gradient steps
(replay mode). The ledger is written into the manifest and into ``ckpt.stats``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class GroupRecord:
    index: int
    nbytes: int
    version: int | None = None  # the optimizer step whose result this group's copy holds
    enqueued_s: float | None = None  # seconds after the request
    landed_s: float | None = None


@dataclass
class CheckpointLedger:
    requested_step: int  # the step after which the checkpoint was requested
    started_step: int  # the step its copies started after: later when it waited for a free slot
    target_version: int
    window: int
    mode: str
    groups: list[GroupRecord]
    requested_at: float = field(default_factory=time.perf_counter)
    # step -> groups whose gradients (as the optimizer consumed them) were logged for it
    gradient_steps: dict[int, list[int]] = field(default_factory=dict)
    hyperparameter_steps: list[int] = field(default_factory=list)
    closed_early_at: int | None = None
    complete_s: float | None = None
    boundary: str | None = None  # where stateful objects were captured: "step()" or "post-hook"
    window_choice: dict[str, Any] | None = None
    # The step of a snapshot this one replaces: its gradients were written in place before their copy landed.
    restarted_from: int | None = None
    scheduled_version: int | None = None  # every=N: the version it was scheduled to hold (None: request())

    def _since_request(self) -> float:
        return time.perf_counter() - self.requested_at

    def group_enqueued(self, index: int, version: int) -> None:
        g = self.groups[index]
        g.version = version
        g.enqueued_s = self._since_request()

    def gradients_logged(self, step: int, groups: list[int]) -> None:
        self.gradient_steps[step] = list(groups)
        self.hyperparameter_steps.append(step)

    def mark_complete(self) -> None:
        self.complete_s = self._since_request()

    def to_json(self) -> dict[str, Any]:
        return {
            "requested_step": self.requested_step,
            "started_step": self.started_step,
            "target_version": self.target_version,
            "window": self.window,
            "mode": self.mode,
            "groups": [
                {"index": g.index, "nbytes": g.nbytes, "version": g.version, "enqueued_s": g.enqueued_s, "landed_s": g.landed_s}
                for g in self.groups
            ],
            "gradient_steps": {str(k): v for k, v in sorted(self.gradient_steps.items())},
            "hyperparameter_steps": list(self.hyperparameter_steps),
            "closed_early_at": self.closed_early_at,
            "complete_s": self.complete_s,
            "boundary": self.boundary,
            "window_choice": self.window_choice,
            "restarted_from": self.restarted_from,
            "scheduled_version": self.scheduled_version,
        }
