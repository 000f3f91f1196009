"""The engine's blocking calls: ``wait``, ``close`` and leaving on an error, never called from a hook; and the one
wait a hook may do, for a host slot at a scheduled checkpoint's step (a stall, without a host-device sync).

Each blocking call closes the open windows at the current step (or abandons them, on an error),
lands the copies, hands the snapshots to the writer and waits for its answers,
within a deadline and with the writer's liveness checked at every wait.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

from ...errors import CheckpointTimeoutError, OverlapCkptError
from ...format.manifest import CheckpointInfo
from ..consistency.snapshot import SnapshotState
from .completion import SnapshotCompletion

# A hook waiting for a host slot looks at the copies' events and the writer's pipe this often.
SLOT_POLL_S = 0.002

if TYPE_CHECKING:
    from .engine_parts import EngineParts


class BlockingCalls:
    """``wait``, ``close``, leaving on an error; the hook's wait for a host slot at a scheduled step."""

    def __init__(self, parts: EngineParts, completion: SnapshotCompletion) -> None:
        self.p = parts
        self.s = parts.state
        self.completion = completion

    def wait(self, timeout_s: float | None, start_due: Callable[[], None]) -> list[CheckpointInfo]:
        """Finish every requested snapshot now and block until the writer committed each (``start_due`` starts what is due)."""
        if self.s.dead is not None:
            raise self.s.dead
        self.completion.settle(start_due)
        self.drain(timeout_s, start_due)
        return self.p.dispatcher.take_committed()

    def drain(self, timeout_s: float | None, start_due: Callable[[], None] | None = None) -> None:
        """Close every open window now, land its copies and block until the writer committed each.

        ``start_due``: start what is pending and due, at each turn (``wait()``); None starts nothing.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            if start_due is not None:
                # A deferred request starts as soon as a slot is free, at the current step.
                start_due()
            for snap in list(self.s.snapshots):
                self.p.copies.close_window(snap, self.s.step_count, self.s.hook_serial)
                if snap.state == SnapshotState.AT_BOUNDARY:
                    self.s.close_boundary(snap, provisional=False)
                for t in snap.tickets:
                    self.p.copier.wait(t)
            self.completion.progress()
            self.completion.settle(start_due)
            if not self.s.snapshots and not self.p.dispatcher.in_flight and not (start_due and self.p.requests.due_by(self.s.step_count)):
                break
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise CheckpointTimeoutError(
                    f"checkpoints of steps {self.unfinished_versions()} were not committed within "
                    f"timeout_s={timeout_s}; pass a larger timeout_s or None"
                )
            if self.p.dispatcher.in_flight or self.p.link.writer.awaiting_responses:
                try:
                    self.p.dispatcher.wait_one(remaining)
                except TimeoutError:
                    continue  # the deadline check above raises the named error
            self.completion.settle(start_due)

    def wait_for_free_slot(self) -> float | None:
        """A scheduled checkpoint at its version's step, every slot busy: wait for one, without a host-device sync.

        The seconds this hook blocked; None when it did not: the writer's answer that frees a
        slot had already arrived, and reading it was enough.

        Open windows (an unscheduled request's) close now, as ``wait()`` closes them. Then
        the hook polls: the copies' events by query, the writer's answers by a wait on its
        pipe of at most ``SLOT_POLL_S``. A stall, but never an event or stream
        synchronize, which the device's hooks must not do (``docs/gpu.md``).
        """
        started = time.perf_counter()
        for snap in list(self.s.snapshots):
            self.p.copies.close_window(snap, self.s.step_count, self.s.hook_serial)
            if snap.state == SnapshotState.AT_BOUNDARY:
                self.s.close_boundary(snap, provisional=False)
        blocked = False
        while not self.p.slots.may_have_free_slot():
            self.completion.progress()
            self.completion.settle(start_due=None)  # the start that waits goes on once this returns
            if self.p.slots.may_have_free_slot():
                break
            blocked = True
            if self.p.dispatcher.in_flight or self.p.link.writer.awaiting_responses:
                try:
                    self.p.dispatcher.wait_one(SLOT_POLL_S)
                except TimeoutError:
                    pass
            else:
                # Copies still landing: nothing to block on without synchronizing; look again shortly.
                time.sleep(SLOT_POLL_S)
        return time.perf_counter() - started if blocked else None

    def abandon(self, timeout_s: float) -> list[CheckpointInfo]:
        """Leaving on an error: commit what is complete in host memory within ``timeout_s``, drop the rest.

        Open windows are abandoned (never closed early: the state may be mid-update when
        an exception unwinds). A snapshot whose groups are all enqueued and whose
        boundary was captured lands and is sent; the writer's answers are awaited up to
        the deadline. Nothing here raises: the caller's exception must come through.
        """
        deadline = time.monotonic() + timeout_s
        self.p.requests.clear()
        for snap in list(self.s.snapshots):
            if snap.all_enqueued and snap.version is not None:
                if snap.state == SnapshotState.AT_BOUNDARY:
                    self.s.close_boundary(snap, provisional=False)
                for t in snap.tickets:
                    self.p.copier.wait(t)
            else:
                self.p.slots.drop(snap.slot, snap.tickets)
                self.s.snapshots.remove(snap)
                self.s.snapshots_dropped += 1
        try:
            self.completion.progress()
            while self.p.dispatcher.in_flight and self.p.dispatcher.error is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    self.p.dispatcher.wait_one(remaining)
                except TimeoutError:
                    break
        except OverlapCkptError as e:
            warnings.warn(f"overlapckpt: while leaving on an error, the pending checkpoints could not commit: {e}", stacklevel=3)
        if self.p.dispatcher.error is not None:
            warnings.warn(f"overlapckpt: while leaving on an error: {self.p.dispatcher.error}", stacklevel=3)
            self.p.dispatcher.error = None
        return self.p.dispatcher.take_committed()

    def unfinished_versions(self) -> list[int | None]:
        return [s.version for s in self.s.snapshots] + self.p.dispatcher.sent_versions()
