"""Which window (and so which mode) the next snapshot uses.

A fixed ``window`` is used as is, except that replay cannot follow GradScaler's
fused step, which falls back to window 1 (exact at the request). ``window="auto"``
asks the tuner (``autowindow.py``) per checkpoint, from the step phases the phase
timer measured and the copy bandwidth of the previous checkpoint.
"""

from __future__ import annotations

from ...settings import AUTO_WINDOW
from ..copying.layout import StateLayout
from ..copying.plan_cache import PlanCache
from .autowindow import PhaseTimer, WindowChoice, WindowTuner, copy_schedule
from .snapshot import SnapshotMode
from .stage_area import StagingArea


class WindowPolicy:
    """The window setting, the tuner, and what rules windows out."""

    def __init__(
        self,
        window: int | str,
        consistency: SnapshotMode,
        max_window: int,
        gap_timer: PhaseTimer | None,
        gradients_fenced: bool,
        distributed: bool = False,
    ) -> None:
        self.window_setting = window
        self.consistency = consistency
        self.tuner = WindowTuner(max_window) if window == AUTO_WINDOW else None
        self.gap_timer = gap_timer
        # Replay's gradient copies: fenced after the step they feed (CPU), or cloned and
        # drained on the side stream ahead of the next group's copy (CUDA).
        self.gradients_fenced = gradients_fenced
        self.widest_window = max_window if window == AUTO_WINDOW else int(window)
        self.grad_scaler_seen = False  # GradScaler's fused path: replay cannot follow it
        self.replay_unfollowable = False  # a pre-hook writes copied state in place (replay_guard.py)
        # Distributed: every rank must use the same window, so "auto" uses the window the
        # writers agreed on after the previous commit, never this rank's own figures.
        self.distributed = distributed
        self.agreed_window: int | None = None

    def mode_for(self, window: int) -> SnapshotMode:
        return SnapshotMode.SINGLE_STEP if window == 1 else self.consistency

    @property
    def replay_blocked(self) -> bool:
        return self.consistency == SnapshotMode.REPLAY and (self.grad_scaler_seen or self.replay_unfollowable)

    def choose(self, plans: PlanCache, staging: StagingArea, layout: StateLayout | None = None) -> tuple[int, WindowChoice | None]:
        """The window of a snapshot starting now, and the tuner's choice record (None for a fixed window).

        ``layout``: the state's, if the caller has it; else taken from ``plans`` only when the
        tuner needs it (a fixed window does not: the layout's fingerprint walks every tensor).
        """
        if self.tuner is None:
            return (1 if self.replay_blocked else int(self.window_setting)), None
        self._collect_phases()
        if self.distributed:
            return self._agreed_choice(self.tuner)
        choice = self._tuned(self.tuner, plans.layout() if layout is None else layout, plans, staging)
        return choice.window_steps, choice

    def propose(self, plans: PlanCache, staging: StagingArea, layout: StateLayout) -> int | None:
        """Distributed ``window="auto"``: this rank's choice for the next checkpoint, for the writers to agree on."""
        if not (self.distributed and self.tuner is not None):
            return None
        self._collect_phases()
        return self._tuned(self.tuner, layout, plans, staging).window_steps

    def _collect_phases(self) -> None:
        if self.gap_timer is not None and self.tuner is not None:
            for phase, seconds in self.gap_timer.collect():
                if phase == "fwd_bwd":
                    self.tuner.observe_compute_gap(seconds)
                else:
                    self.tuner.observe_optimizer_step(seconds)

    def _agreed_choice(self, tuner: WindowTuner) -> tuple[int, WindowChoice]:
        if self.replay_blocked:
            window, reason = 1, "GradScaler drives a fused step: replay falls back to window 1 on every rank"
        elif self.agreed_window is not None:
            window = self.agreed_window
            reason = "agreed by the writers after the previous commit: the widest window any rank proposed"
        else:
            window = self.widest_window
            reason = "first checkpoint of a distributed run: max_window on every rank (nothing agreed yet)"
        return window, WindowChoice(
            window_steps=window,
            reason=reason,
            max_window=tuner.max_window,
            fill_fraction=tuner.fill_fraction,
            fwd_bwd_s=tuner.fwd_bwd_s,
            optimizer_step_s=tuner.optimizer_step_s,
            copy_bytes_per_s=tuner.copy_bytes_per_s,
        )

    def _tuned(self, tuner: WindowTuner, layout: StateLayout, plans: PlanCache, staging: StagingArea) -> WindowChoice:

        def allowed(w: int) -> bool:
            if w > 1 and self.replay_blocked:
                return False
            return self.mode_for(w) != SnapshotMode.STAGE or staging.fits(staging.needed_bytes(plans.plan(layout, w), layout))

        return tuner.choose(
            lambda w: copy_schedule(plans.plan(layout, w), layout, self.mode_for(w).value, self.gradients_fenced),
            allowed,
        )

    def observe_copies(self, nbytes: int, seconds: float) -> None:
        if self.tuner is not None:  # every copy has landed: the bandwidth the next choice uses
            self.tuner.observe_copies(nbytes, seconds)
