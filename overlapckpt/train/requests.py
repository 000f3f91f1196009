"""Checkpoint requests, from the step they follow to the snapshot that answers them.

A request (``every=N``, ``request()``, a restart) is *pending* until a snapshot starts
for it. It starts at once when a host slot is free; otherwise it is *deferred* to
the first hook that finds one, and starts at that later step. Requests pending
together are *merged*: one snapshot, at the step it starts, answers them all. Both
cases are logged as a warning with the reason, since the checkpoint then holds a
later version than was asked for.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger("overlapckpt.requests")


@dataclass(frozen=True)
class StartingRequest:
    """What the snapshot starting now answers."""

    requested_step: int  # the earliest pending request's step
    deferred: bool  # it waited for a free slot
    restarted_from: int | None  # the started step of a snapshot this one replaces


class RequestQueue:
    """Pending requests, deferral accounting and the started step of the last snapshot."""

    def __init__(self) -> None:
        self._pending: list[int] = []  # the steps the pending requests came after, in order
        self._waiting_for_slot = False
        self._last_started_step: int | None = None
        self._restarted_from: int | None = None
        self._busy_reason = ""
        self.deferrals = 0  # requests that had to wait for a free slot

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def add(self, step: int) -> None:
        self._pending.append(step)

    def clear(self) -> None:
        self._pending = []

    def answered_at(self, step: int) -> bool:
        """A snapshot started at this very step is under way: it answers what is pending too."""
        if self._last_started_step != step:
            return False
        self._pending = []
        return True

    def answered_by_version(self, step: int) -> None:
        """A snapshot already holds the state of ``step``: it answers everything pending."""
        pending, self._pending = self._pending, []
        self._waiting_for_slot = False
        if pending != [step]:
            log.warning(
                "checkpoint requests after step(s) %s are answered by the checkpoint of version %d, which already "
                "holds the state at step %d: %s",
                pending,
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

    def take(self, step: int) -> StartingRequest:
        """Start a snapshot at ``step`` for everything pending; log a deferral or a merge."""
        pending, self._pending = self._pending, []
        deferred, self._waiting_for_slot = self._waiting_for_slot, False
        started = StartingRequest(requested_step=pending[0], deferred=deferred, restarted_from=self._restarted_from)
        self._restarted_from = None
        self._last_started_step = step
        later = pending[1:]
        if deferred or later:
            merged = f"; the requests after step(s) {later} were merged into it" if later else ""
            log.warning(
                "checkpoint requested after step %d started at step %d: %s%s",
                pending[0],
                step,
                self._busy_reason or "no host slot was free",
                merged,
            )
        return started

    def put_back(self, requested_step: int, started_step: int) -> None:
        """A snapshot that cannot reach its version is replaced by one started at the next chance."""
        self._restarted_from = started_step
        self._pending.insert(0, requested_step)
        self._last_started_step = None
