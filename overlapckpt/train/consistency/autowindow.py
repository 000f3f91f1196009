"""``window="auto"``: pick the overlap window from measured step phases and copy bandwidth.

Where each copy of a window has to fit (``engine.py`` places the fences):

* the group copied after step s+i runs on the side stream while forward and
  backward of the next iteration run; the next optimizer step waits for it. It
  has to fit in forward+backward.
* replay's gradients for step s+i are copied just before that optimizer step and
  fenced right after it (the next iteration may zero them in place), so they have
  to fit in the optimizer step itself, which is short: a wider window copies
  more of them per step, and stops paying off.
* stage mode drains staged groups from device memory no training kernel touches,
  so only group 0 is fenced.

The tuner picks the smallest W whose copies all fit with a margin: the smallest
window keeps the version closest to the request and costs the least gradient
logging (replay) or staging memory (stage). Where none fits, it picks the W with
the least estimated stall. Every input is measured, never assumed:

* forward+backward and the optimizer step: the gaps between the hooks, timed with
  CUDA events on the compute stream (host clocks run ahead of the GPU) or with the
  host clock on CPU; the median of the last samples is used.
* copy bandwidth: bytes over copy time of the latest checkpoint's copies, timed
  with events on the side stream (so it is the bandwidth achieved while sharing
  PCIe with training, not a quiet-machine peak).

The first checkpoint has no bandwidth measured yet and takes ``max_window``, the
choice that copies the fewest bytes per step; every later one is chosen again
from the newest figures. Each choice and its inputs go into the ledger.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..copying.layout import StateLayout
from ..copying.plan import CopyPlan

# A step's copies may fill this share of forward+backward. The rest is margin for
# step-to-step noise and for the PCIe traffic of training itself.
AUTO_FILL_FRACTION = 0.8
# Forward+backward samples the median is taken over: enough to ignore one slow step.
COMPUTE_GAP_SAMPLES = 16


@dataclass(frozen=True)
class WindowChoice:
    """The window one checkpoint uses, and the figures it was chosen from."""

    window_steps: int
    reason: str
    max_window: int
    fill_fraction: float
    fwd_bwd_s: float | None = None
    optimizer_step_s: float | None = None
    copy_bytes_per_s: float | None = None
    # per window: the largest fenced group and gradient copy, whether all fit, the estimated stall
    candidates: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "window_steps": self.window_steps,
            "reason": self.reason,
            "max_window": self.max_window,
            "fill_fraction": self.fill_fraction,
            "fwd_bwd_s": self.fwd_bwd_s,
            "optimizer_step_s": self.optimizer_step_s,
            "copy_bytes_per_s": self.copy_bytes_per_s,
            "candidates": list(self.candidates),
        }


# Per step of a window: (bytes of the group copied after it that the next optimizer step
# waits for, bytes of gradients copied before its optimizer step and fenced after it).
CopySchedule = list[tuple[int, int]]


class WindowTuner:
    """Keeps the measurements and picks a window per checkpoint."""

    def __init__(self, max_window: int, fill_fraction: float = AUTO_FILL_FRACTION) -> None:
        self.max_window = max_window
        self.fill_fraction = fill_fraction
        self._fwd_bwd_s: deque[float] = deque(maxlen=COMPUTE_GAP_SAMPLES)
        self._optimizer_step_s: deque[float] = deque(maxlen=COMPUTE_GAP_SAMPLES)
        self._copy_bytes_per_s: float | None = None

    def observe_compute_gap(self, seconds: float) -> None:
        """Forward+backward: one step's post-hook to the next step's pre-hook."""
        if seconds > 0:
            self._fwd_bwd_s.append(seconds)

    def observe_optimizer_step(self, seconds: float) -> None:
        """The optimizer step: its pre-hook to its post-hook."""
        if seconds > 0:
            self._optimizer_step_s.append(seconds)

    def observe_copies(self, nbytes: int, seconds: float) -> None:
        """One checkpoint's copies: the newest bandwidth replaces the older one."""
        if nbytes > 0 and seconds > 0:
            self._copy_bytes_per_s = nbytes / seconds

    @property
    def fwd_bwd_s(self) -> float | None:
        return statistics.median(self._fwd_bwd_s) if self._fwd_bwd_s else None

    @property
    def optimizer_step_s(self) -> float | None:
        return statistics.median(self._optimizer_step_s) if self._optimizer_step_s else None

    @property
    def copy_bytes_per_s(self) -> float | None:
        return self._copy_bytes_per_s

    def choose(self, schedule: Callable[[int], CopySchedule], allowed: Callable[[int], bool]) -> WindowChoice:
        """The smallest allowed W whose copies all fit; else the one with the least estimated stall.

        ``schedule(w)``: the copies of each step of a window of w (see ``CopySchedule``).
        ``allowed(w)``: False where the window cannot be used (stage memory budget).
        """
        windows = [w for w in range(1, self.max_window + 1) if allowed(w)] or [1]
        fwd_bwd_s, opt_s, bandwidth = self.fwd_bwd_s, self.optimizer_step_s, self._copy_bytes_per_s
        base: dict[str, Any] = {
            "max_window": self.max_window,
            "fill_fraction": self.fill_fraction,
            "fwd_bwd_s": fwd_bwd_s,
            "optimizer_step_s": opt_s,
            "copy_bytes_per_s": bandwidth,
        }
        if fwd_bwd_s is None or bandwidth is None:
            missing = "forward+backward time" if fwd_bwd_s is None else "copy bandwidth"
            return WindowChoice(
                window_steps=max(windows),
                reason=f"no {missing} measured yet: the widest allowed window copies the fewest bytes per step",
                **base,
            )
        opt_s = opt_s or 0.0
        candidates = [self._estimate(w, schedule(w), fwd_bwd_s, opt_s, bandwidth) for w in windows]
        for c in candidates:
            if c["fits"]:
                return WindowChoice(
                    window_steps=c["window_steps"],
                    reason=(
                        f"smallest window whose copies fit: groups within {self.fill_fraction:g} x forward+backward "
                        f"({fwd_bwd_s:.6g} s), gradients within {self.fill_fraction:g} x the optimizer step ({opt_s:.6g} s)"
                    ),
                    candidates=candidates,
                    **base,
                )
        best = min(candidates, key=lambda c: (c["estimated_stall_s"], c["window_steps"]))
        return WindowChoice(
            window_steps=best["window_steps"],
            reason=(
                f"no window up to max_window={self.max_window} hides every copy; this one has the least estimated "
                f"stall, {best['estimated_stall_s']:.6g} s per checkpoint"
            ),
            candidates=candidates,
            **base,
        )

    def _estimate(
        self, window_steps: int, steps: CopySchedule, fwd_bwd_s: float, opt_s: float, copy_bytes_per_s: float
    ) -> dict[str, Any]:
        """One window's candidate: its largest copies, whether they all fit, and the stall they would cause."""
        group_s = [g / copy_bytes_per_s for g, _ in steps]
        grad_s = [gr / copy_bytes_per_s for _, gr in steps]
        fits = all(t <= self.fill_fraction * fwd_bwd_s for t in group_s) and all(
            t <= self.fill_fraction * opt_s for t in grad_s if t > 0
        )
        stall_s = sum(max(0.0, t - fwd_bwd_s) for t in group_s) + sum(max(0.0, t - opt_s) for t in grad_s if t > 0)
        return {
            "window_steps": window_steps,
            "largest_group_bytes": max(g for g, _ in steps),
            "largest_gradient_bytes": max(gr for _, gr in steps),
            "fits": fits,
            "estimated_stall_s": stall_s,
        }


def copy_schedule(plan: CopyPlan, layout: StateLayout, mode: str, gradients_fenced: bool = True) -> CopySchedule:
    """What each step of ``plan``'s window copies under a fence (see the module docstring).

    ``gradients_fenced``: replay's gradients are fenced right after the step they feed
    (the copier reads ``.grad`` itself). Otherwise they are cloned on the device and
    drained unfenced, but on the same side stream ahead of the next group's copy, so
    the next optimizer step waits for both: their bytes count with the group's.
    """
    param_bytes = {fqn: p.numel() * p.element_size() for fqn, p in zip(layout.param_fqns, layout.param_locals)}
    out: CopySchedule = []
    grads_so_far = 0
    for group in plan.groups:
        fenced_group = group.nbytes if (mode != "stage" or group.index == 0) else 0
        grads = grads_so_far if mode == "replay" else 0
        out.append((fenced_group, grads) if gradients_fenced else (fenced_group + grads, 0))
        grads_so_far += sum(param_bytes[f] for f in group.param_fqns)
    return out


# The four hook boundaries a step passes through, in order.
FWD_BWD_END, OPT_START, OPT_END, FWD_BWD_START = "fwd_bwd_end", "opt_start", "opt_end", "fwd_bwd_start"
# Which boundary closes which phase, and the boundary that opened it.
_PHASES = {FWD_BWD_END: (FWD_BWD_START, "fwd_bwd"), OPT_END: (OPT_START, "optimizer_step")}


class PhaseTimer:
    """Stamps at the hook boundaries; a phase is the span from its opening boundary to its closing one."""

    _MAX_PENDING = 2 * COMPUTE_GAP_SAMPLES  # phases not yet collected; the oldest are dropped

    def __init__(self) -> None:
        self._opened: dict[str, Any] = {}
        self._pending: deque[tuple[str, Any, Any]] = deque(maxlen=self._MAX_PENDING)

    def mark(self, boundary: str) -> None:
        stamp = self._stamp()
        if boundary in _PHASES:
            opener, phase = _PHASES[boundary]
            started = self._opened.pop(opener, None)
            if started is not None:
                self._pending.append((phase, started, stamp))
        else:
            self._opened[boundary] = stamp

    def collect(self) -> list[tuple[str, float]]:
        """(phase, seconds) of every phase whose end can be read now, oldest first."""
        out = []
        while self._pending and self._readable(self._pending[0][2]):
            phase, start, end = self._pending.popleft()
            out.append((phase, self._seconds(start, end)))
        return out

    def _stamp(self) -> Any:
        raise NotImplementedError

    def _readable(self, end: Any) -> bool:
        return True

    def _seconds(self, start: Any, end: Any) -> float:
        return end - start


class HostGapTimer(PhaseTimer):
    """Step phases on CPU: the host clock at the hook boundaries."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        super().__init__()
        self.clock = clock

    def _stamp(self) -> float:
        return self.clock()


class CudaGapTimer(PhaseTimer):
    """Step phases on the GPU: events on the compute stream, read once both have run.

    The host runs ahead of the device, so host clocks would time the launches, not
    the work the side stream's copies overlap. The events are only queried, never
    synchronized, so measuring costs the training stream nothing.
    """

    _MAX_PENDING = 16  # event pairs waiting to complete; the oldest are dropped if the device lags this far

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device

    def _stamp(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def _readable(self, end: torch.cuda.Event) -> bool:
        return end.query()

    def _seconds(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return start.elapsed_time(end) / 1000.0


def make_gap_timer(device: torch.device) -> HostGapTimer | CudaGapTimer:
    if device.type == "cuda" and torch.cuda.is_available():
        return CudaGapTimer(device)
    return HostGapTimer()
