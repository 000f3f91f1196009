"""``window="auto"``: pick the overlap window from measured compute time and copy bandwidth.

The copy of step s+i runs on the side stream while forward and backward of the
next iteration run on the compute stream; the next optimizer step waits for it.
So a window hides the copy when the bytes one step copies, at the measured
bandwidth, take less than forward+backward. The tuner picks the smallest W for
which that holds with a margin: the smallest window keeps the snapshot's version
closest to the request, and costs the least gradient logging (replay) or staging
memory (stage).

Both inputs are measured, never assumed:

* forward+backward: the gap between one step's post-hook and the next step's
  pre-hook, timed with CUDA events on the compute stream (host clocks run ahead of
  the GPU) or with the host clock on CPU. The median of the last samples is used.
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

from .plan import CopyPlan
from .state import StateLayout

# A step's copies may fill this share of forward+backward. The rest is margin for
# step-to-step noise and for the PCIe traffic of training itself.
AUTO_FILL_FRACTION = 0.8
# Forward+backward samples the median is taken over: enough to ignore one slow step.
COMPUTE_GAP_SAMPLES = 16
DEFAULT_MAX_WINDOW = 8
AUTO_WINDOW = "auto"


@dataclass(frozen=True)
class WindowChoice:
    """The window one checkpoint uses, and the figures it was chosen from."""

    window_steps: int
    reason: str
    max_window: int
    fill_fraction: float
    fwd_bwd_s: float | None = None
    copy_bytes_per_s: float | None = None
    # window -> bytes the busiest step of that window copies, and its time at the bandwidth
    candidates: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "window_steps": self.window_steps,
            "reason": self.reason,
            "max_window": self.max_window,
            "fill_fraction": self.fill_fraction,
            "fwd_bwd_s": self.fwd_bwd_s,
            "copy_bytes_per_s": self.copy_bytes_per_s,
            "candidates": list(self.candidates),
        }


class WindowTuner:
    """Keeps the measurements and picks a window per checkpoint."""

    def __init__(self, max_window: int, fill_fraction: float = AUTO_FILL_FRACTION) -> None:
        self.max_window = max_window
        self.fill_fraction = fill_fraction
        self._gaps_s: deque[float] = deque(maxlen=COMPUTE_GAP_SAMPLES)
        self._copy_bytes_per_s: float | None = None

    def observe_compute_gap(self, seconds: float) -> None:
        if seconds > 0:
            self._gaps_s.append(seconds)

    def observe_copies(self, nbytes: int, seconds: float) -> None:
        """One checkpoint's copies: the newest bandwidth replaces the older one."""
        if nbytes > 0 and seconds > 0:
            self._copy_bytes_per_s = nbytes / seconds

    @property
    def fwd_bwd_s(self) -> float | None:
        return statistics.median(self._gaps_s) if self._gaps_s else None

    @property
    def copy_bytes_per_s(self) -> float | None:
        return self._copy_bytes_per_s

    def choose(self, busiest_step_bytes: Callable[[int], int], allowed: Callable[[int], bool]) -> WindowChoice:
        """The smallest allowed W whose busiest step's copy fits in forward+backward.

        ``busiest_step_bytes(w)``: bytes copied in the busiest step of a window of w
        (its largest group, plus the gradients replay logs in that step).
        ``allowed(w)``: False where the window cannot be used (stage memory budget).
        """
        windows = [w for w in range(1, self.max_window + 1) if allowed(w)] or [1]
        fwd_bwd_s, bandwidth = self.fwd_bwd_s, self._copy_bytes_per_s
        base = {"max_window": self.max_window, "fill_fraction": self.fill_fraction, "fwd_bwd_s": fwd_bwd_s, "copy_bytes_per_s": bandwidth}
        if fwd_bwd_s is None or bandwidth is None:
            missing = "forward+backward time" if fwd_bwd_s is None else "copy bandwidth"
            return WindowChoice(
                window_steps=max(windows),
                reason=f"no {missing} measured yet: the widest allowed window copies the fewest bytes per step",
                **base,
            )
        budget_s = self.fill_fraction * fwd_bwd_s
        candidates = []
        for w in windows:
            nbytes = busiest_step_bytes(w)
            candidates.append({"window_steps": w, "busiest_step_bytes": nbytes, "busiest_step_copy_s": nbytes / bandwidth})
        for c in candidates:
            if c["busiest_step_copy_s"] <= budget_s:
                return WindowChoice(
                    window_steps=c["window_steps"],
                    reason=(
                        f"smallest window whose busiest step copies in {c['busiest_step_copy_s']:.6g} s, within "
                        f"{self.fill_fraction:g} x forward+backward = {budget_s:.6g} s"
                    ),
                    candidates=candidates,
                    **base,
                )
        best = min(candidates, key=lambda c: (c["busiest_step_bytes"], c["window_steps"]))
        return WindowChoice(
            window_steps=best["window_steps"],
            reason=(
                f"no window up to max_window={self.max_window} hides the copy within {budget_s:.6g} s per step; "
                "this one copies the fewest bytes per step (raise max_window to hide more)"
            ),
            candidates=candidates,
            **base,
        )


def busiest_step_bytes(plan: CopyPlan, layout: StateLayout, mode: str) -> int:
    """Bytes the busiest step of ``plan``'s window moves over PCIe.

    Step s+i copies group i. In replay mode, step s+i (i >= 1) also copies the
    gradients of groups 0..i-1, so a wider window stops paying off once the
    gradients outweigh the group: that is the cost of exactness without staging.
    Stage mode's device-to-device clone at the request does not cross PCIe.
    """
    param_bytes = {fqn: p.numel() * p.element_size() for fqn, p in zip(layout.param_fqns, layout.params)}
    busiest, grads_so_far = 0, 0
    for group in plan.groups:
        step_bytes = group.nbytes + (grads_so_far if mode == "replay" else 0)
        busiest = max(busiest, step_bytes)
        grads_so_far += sum(param_bytes[f] for f in group.param_fqns)
    return busiest


class HostGapTimer:
    """Forward+backward on CPU: the host clock between the post-hook and the next pre-hook."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self._post_hook_at_s: float | None = None
        self._gaps_s: list[float] = []

    def mark_post_hook(self) -> None:
        self._post_hook_at_s = self.clock()

    def mark_pre_hook(self) -> None:
        if self._post_hook_at_s is not None:
            self._gaps_s.append(self.clock() - self._post_hook_at_s)
            self._post_hook_at_s = None

    def collect(self) -> list[float]:
        out, self._gaps_s = self._gaps_s, []
        return out


class CudaGapTimer:
    """Forward+backward on the GPU: events on the compute stream, read once both have run.

    The host runs ahead of the device, so host clocks would time the launches, not
    the work the side stream's copy overlaps. The events are only queried, never
    synchronized, so measuring costs the training stream nothing.
    """

    # Event pairs waiting to complete; older ones are dropped if the device lags this far.
    _MAX_PENDING = 8

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._post_event: torch.cuda.Event | None = None
        self._pending: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque(maxlen=self._MAX_PENDING)

    def mark_post_hook(self) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        self._post_event = event

    def mark_pre_hook(self) -> None:
        if self._post_event is None:
            return
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        self._pending.append((self._post_event, event))
        self._post_event = None

    def collect(self) -> list[float]:
        out = []
        while self._pending and self._pending[0][1].query():
            start, end = self._pending.popleft()
            out.append(start.elapsed_time(end) / 1000.0)
        return out


def make_gap_timer(device: torch.device) -> HostGapTimer | CudaGapTimer:
    if device.type == "cuda" and torch.cuda.is_available():
        return CudaGapTimer(device)
    return HostGapTimer()
