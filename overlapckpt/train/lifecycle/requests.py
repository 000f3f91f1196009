"""Checkpoint requests, from the step they follow to the snapshot that answers them.

Two kinds of request:

* **scheduled** (``every=N``): the version is known in advance, N, 2N, ... A replay
  window of W steps holds the version its last group reaches, s+W-1, so the request
  for version v opens W-1 steps early, at v-W+1 (``CheckpointSchedule``); window 1 and
  stage mode hold the version they start at, so theirs opens at v. It starts as soon
  as a host slot is free, with a window cut short if it starts late, so that its
  version is still v; only a slot that frees after v makes it late.
* **unscheduled** (``request()``, a restart): the state as of the step it follows; it
  starts at once, and a replay window makes its version later.

A request is *pending* until a snapshot starts for it. When no host slot is free it is
*deferred* to the first hook that finds one. Requests pending together are *merged*:
one snapshot answers every unscheduled one and every scheduled one whose version it
reaches. Deferrals and merges are logged as a warning with the reason, since the
checkpoint then holds a later version than was asked for.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

from ...format.tiers import ROOT_TIER
from ..consistency.snapshot import StartingRequest

log = logging.getLogger("overlapckpt.requests")


@dataclass(frozen=True)
class PendingRequest:
    step: int  # the step it came after (a scheduled one: the step its window opened at)
    scheduled_version: int | None  # every=N: the version asked for; None for request()


class CheckpointSchedule:
    """``every=N`` (and ``local_every=M``): the versions N, 2N, ... (and M, 2M, ...) and the step at which each one's window opens.

    One snapshot serves both tiers where their versions meet (``format/tiers.py``'s ``tiers_for``
    says which tiers each version goes to).
    """

    def __init__(self, every: int | None, local_every: int | None = None) -> None:
        self.every = every
        self.cadences = tuple(c for c in (every, local_every) if c is not None)
        self._opened_up_to = 0  # versions up to this one have been opened

    @property
    def shortest_gap(self) -> int:
        """The fewest steps between two scheduled versions (1 with no schedule)."""
        return math.gcd(*self.cadences) if self.cadences else 1

    def _next_after(self, version: int) -> int:
        return min((version // c + 1) * c for c in self.cadences)

    def continue_from(self, step: int) -> None:
        """After a restore: versions up to ``step`` are in the past."""
        self._opened_up_to = step

    def opening(self, step: int, lead_steps: int) -> list[int]:
        """The scheduled versions whose window opens after ``step`` (a window starts ``lead_steps`` before its version)."""
        if not self.cadences:
            return []
        out = []
        version = self._next_after(self._opened_up_to)
        while version - lead_steps <= step:
            if version >= step:  # a version already in the past (lead_steps shrank) is not asked for late
                out.append(version)
            self._opened_up_to = version
            version = self._next_after(version)
        return out


class RequestQueue:
    """Pending requests, deferral accounting and the started step of the last snapshot.

    ``tiers_of(scheduled_version, on_request)`` says which tiers a snapshot answering such
    requests goes to (``TierSettings.tiers_for``): a snapshot for the local tier alone
    answers no ``request()``, which must reach the root.
    """

    def __init__(self, tiers_of: Callable[[int | None, bool], tuple[str, ...]] | None = None) -> None:
        self._tiers_of = tiers_of if tiers_of is not None else (lambda version, on_request: (ROOT_TIER,))
        self._last_started_reaches_root = True
        self._pending: list[PendingRequest] = []
        self._waiting_for_slot = False
        self._last_started_step: int | None = None
        self._last_started_version: int | None = None
        self._restarted_from: int | None = None
        self._busy_reason = ""
        self.deferrals = 0  # requests that had to wait for a free slot

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def due_by(self, step: int) -> bool:
        """Whether a pending request is due at ``step``: unscheduled, or scheduled for ``step`` or earlier."""
        return any(r.scheduled_version is None or r.scheduled_version <= step for r in self._pending)

    def add(self, step: int, scheduled_version: int | None = None) -> None:
        self._pending.append(PendingRequest(step, scheduled_version))

    def clear(self) -> None:
        self._pending = []

    def scheduled_version(self) -> int | None:
        """The version the next snapshot must hold: the earliest scheduled one, if no unscheduled request is pending."""
        if any(r.scheduled_version is None for r in self._pending):
            return None
        return min(r.scheduled_version for r in self._pending if r.scheduled_version is not None)

    def _answered_up_to(self, version: int) -> list[PendingRequest]:
        """Remove and return what a snapshot of ``version`` answers; later scheduled versions stay pending."""
        answered = [r for r in self._pending if r.scheduled_version is None or r.scheduled_version <= version]
        self._pending = [r for r in self._pending if r not in answered]
        return answered

    def needs_root(self) -> bool:
        """Whether a pending request must reach the root (a ``request()``, or a version of ``every=``)."""
        return any(ROOT_TIER in self._tiers_of(r.scheduled_version, r.scheduled_version is None) for r in self._pending)

    def answered_at(self, step: int) -> bool:
        """A snapshot started at this very step is under way: it answers what is pending too (all but later schedules)."""
        if self._last_started_step != step or self._last_started_version is None:
            return False
        if not self._last_started_reaches_root and self.needs_root():
            return False  # that one goes to the local tier alone: these need their own snapshot
        self._answered_up_to(self._last_started_version)
        return not self._pending

    def answered_by_version(self, step: int) -> None:
        """A snapshot already holds the state of ``step``: it answers everything pending up to it."""
        answered = self._answered_up_to(step)
        self._waiting_for_slot = False
        if [r.step for r in answered] != [step]:
            log.warning(
                "checkpoint requests after step(s) %s are answered by the checkpoint of version %d, which already "
                "holds the state at step %d: %s",
                [r.step for r in answered],
                step,
                step,
                self._busy_reason or "it was under way when they were made",
            )

    def no_free_slot(self, reason: str) -> None:
        """The first pending request must wait; ``reason`` says what holds the slots."""
        if not self._waiting_for_slot:
            # Counted once per request that has to wait, however many hooks it waits.
            self.deferrals += 1
            self._waiting_for_slot = True
            self._busy_reason = reason

    def take(self, step: int, version: int) -> StartingRequest:
        """Start a snapshot at ``step`` that will hold ``version``, for what it answers; log a deferral or a merge."""
        answered = self._answered_up_to(version)
        deferred, self._waiting_for_slot = self._waiting_for_slot, False
        first = answered[0]
        scheduled = [r.scheduled_version for r in answered if r.scheduled_version is not None]
        scheduled_version = min(scheduled) if scheduled else None
        on_request = any(r.scheduled_version is None for r in answered)
        started = StartingRequest(
            requested_step=first.step, deferred=deferred, restarted_from=self._restarted_from,
            scheduled_version=scheduled_version, tiers=self._tiers_of(scheduled_version, on_request),
        )
        self._last_started_reaches_root = started.reaches_root
        self._restarted_from = None
        self._last_started_step, self._last_started_version = step, version
        later = [r.step for r in answered[1:]]
        missed = bool(scheduled) and min(scheduled) != version
        if (deferred and (missed or not scheduled)) or later:
            merged = f"; the requests after step(s) {later} were merged into it" if later else ""
            what = f"scheduled for version {min(scheduled)}" if scheduled else f"requested after step {first.step}"
            log.warning(
                "checkpoint %s started at step %d and holds version %d: %s%s",
                what,
                step,
                version,
                self._busy_reason or "no host slot was free",
                merged,
            )
        return started

    def put_back(self, requested_step: int, started_step: int, scheduled_version: int | None) -> None:
        """A snapshot that cannot reach its version is replaced by one started at the next chance."""
        self._restarted_from = started_step
        self._pending.insert(0, PendingRequest(requested_step, scheduled_version))
        self._last_started_step = None
