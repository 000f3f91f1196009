"""Starting a snapshot: sizing the host slots, choosing its window and plan, its first copies.

A request starts at the step it was made after, or, when no host slot is free, at
the first later step that has one (``requests.py`` records the deferral). In a
distributed run every rank must start it at the same step, so the hook waits for a
slot instead (``_wait_until_startable``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from ...errors import ConfigError, WriterDiedError
from ..consistency.snapshot import Snapshot, SnapshotMode, SnapshotPlan

log = logging.getLogger("overlapckpt.requests")

if TYPE_CHECKING:
    from ..consistency.autowindow import WindowChoice
    from ..consistency.snapshot import StartingRequest
    from ..copying.layout import StateLayout
    from ..copying.plan import CopyPlan
    from ..copying.slots import HostSlot
    from .engine_parts import EngineParts
    from .pipelined_persist import PipelinedPersist
    from .snapshot_restarts import SnapshotRestarts


class SlotWaits(Protocol):
    """The waits a start may do inside a hook for a host slot (``BlockingCalls`` does them)."""

    def wait_for_free_slot(self) -> float | None:
        """Wait for a free slot without a host-device sync; the seconds blocked, None if the answers already in freed one."""
        ...

    def drain(self, timeout_s: float | None, start_due: Callable[[], None] | None = None) -> None:
        """Close every open window now and block until the writer committed each."""
        ...


class SnapshotStarts:
    """Starting snapshots: host slots sized once, a window and plan per snapshot, its first copies."""

    def __init__(self, parts: EngineParts, waits: SlotWaits, restarts: SnapshotRestarts, pipelined: PipelinedPersist) -> None:
        self.p = parts
        self.s = parts.state
        self.waits = waits
        self.restarts = restarts
        self.pipelined = pipelined

    def prepare(self) -> None:
        """Size and allocate the host slots for the widest window, off the critical path."""
        layout = self.p.plans.layout()
        widest = self.p.windows.widest_window
        plan = self.p.plans.plan(layout, widest)
        replay_possible = self.p.consistency == SnapshotMode.REPLAY and widest > 1
        grad_nbytes = self._grad_nbytes(layout, plan) if replay_possible else 0
        if self.p.consistency == SnapshotMode.STAGE and widest > 1:
            # Outside any checkpoint's hooks: an over-budget or unallocatable staging area
            # is known now, and no checkpoint allocates device memory inside optimizer.step().
            needed = self.p.staging.needed_bytes(plan, layout)
            if self.p.windows.tuner is None or self.p.staging.fits(needed):
                self.p.staging.reserve(needed, widest, layout.nbytes)
        self.p.slots.preallocate(plan.slot_nbytes, grad_nbytes)
        self.s.prepared_fingerprint = layout.fingerprint

    def start_pending(self, closing: bool = False) -> None:
        """Start what is pending if a slot is free (``closing``: wait() or close(), which start nothing not yet due)."""
        try:
            self._start_pending_now(closing)
        except WriterDiedError as e:
            # The writer died while being told of a buffer or plan: replaced (or raised) by
            # SnapshotCompletion.settle; the request stays pending and starts at the next chance.
            self.p.dispatcher.fail(e)

    def _start_pending_now(self, closing: bool) -> None:
        if not self.p.requests.pending:
            return
        if self.s.step_count == 0 and not self.p.optimizer.state:
            self.p.requests.clear()
            raise ConfigError(
                "a checkpoint was requested before the first optimizer.step(): the optimizer has no "
                "state yet, and creating it would change training. Request it after the first step"
            )
        if self.p.requests.answered_at(self.s.step_count):
            return
        scheduled = self.p.requests.scheduled_version()
        if scheduled is not None and (scheduled > self.s.step_count if closing else not self._schedule_reached(scheduled)):
            return  # its window starts at a later step, so that its version is the one asked for
        if self.p.distributed:
            self.wait_until_startable()
        elif scheduled is not None and self.s.step_count >= scheduled and not self.p.slots.may_have_free_slot():
            # The last step that can still hold the version asked for: wait for a slot here
            # (a stall, in the snapshot's waited_for_slot_s) rather than land off the schedule.
            waited_s = self.waits.wait_for_free_slot()
            if waited_s is not None:  # None: the commit had arrived already, and the hook did not wait for it
                self.s.slot_wait_s += waited_s
                log.warning(
                    "the checkpoint scheduled for step %d waited %.3f s in optimizer.step() for the previous one to commit "
                    "(every=%s is shorter than a persist takes, with max_inflight=%d): pass a larger every or max_inflight "
                    "(one host copy of the state each)",
                    self.s.step_count, waited_s, self.p.schedule.every, self.p.slots.max_inflight,
                )
        slot = None
        if self.p.slots.may_have_free_slot():  # before any layout work: a fingerprint walks every tensor
            layout = self.p.plans.layout()
            window, choice = self.p.windows.choose(self.p.plans, self.p.staging, layout)
            if scheduled is not None:
                window = self._window_landing_on(scheduled, window)
            plan, plan_id = self.p.plans.registered(layout, window)
            grad_nbytes = self._grad_nbytes(layout, plan) if self.p.windows.mode_for(window) == SnapshotMode.REPLAY else 0
            slot = self.p.slots.free_slot(plan.slot_nbytes, grad_nbytes)
        if slot is None:
            self.p.requests.no_free_slot(self.busy_reason())
            return
        if self.holds_version(self.s.step_count):
            # A deferred request meets a free slot at the very step a snapshot already holds
            # (a window closed early there): that snapshot answers it; a second would duplicate it.
            self.p.requests.answered_by_version(self.s.step_count)
            return
        version = self.s.step_count + window - 1 if self.p.windows.mode_for(window) == SnapshotMode.REPLAY else self.s.step_count
        self._start_snapshot(slot, self.p.requests.take(self.s.step_count, version), layout, plan, plan_id, choice)

    def _grad_nbytes(self, layout: StateLayout, plan: CopyPlan) -> int:
        tables = self.p.plans.tables(layout, plan)
        return tables.grad_nbytes if tables is not None else 0

    def lead_steps(self) -> int:
        """How many steps before its version a scheduled snapshot's window opens: W-1 for replay, else 0.

        At most ``every - 1`` (with ``local_every``, the shortest gap between scheduled versions, less 1): with ``every`` at or below the window, each window would
        open before the previous one closed; they are cut to ``every`` steps instead.
        """
        if self.p.consistency != SnapshotMode.REPLAY or self.p.windows.replay_blocked:
            return 0
        # every= and local_every=: their versions come as close as the cadences' gcd (4 and 6: 4, 6, 8).
        return min(self.p.windows.widest_window - 1, self.p.schedule.shortest_gap - 1)

    def _schedule_reached(self, version: int) -> bool:
        """Whether a snapshot starting now can hold ``version`` (a replay window ends on it), or ``version`` is due."""
        if self.s.step_count >= version:
            return True
        window, _ = self.p.windows.choose(self.p.plans, self.p.staging)  # the window a snapshot starting now would use
        return self.p.windows.mode_for(window) == SnapshotMode.REPLAY and self.s.step_count + window - 1 >= version

    def _window_landing_on(self, version: int, window: int) -> int:
        """``window``, cut short when a replay snapshot starts late, so that it still ends on ``version``."""
        if self.p.windows.mode_for(window) != SnapshotMode.REPLAY or self.s.step_count > version:
            return window
        return max(1, min(window, version - self.s.step_count + 1))

    def holds_version(self, version: int, reaching_root: bool | None = None) -> bool:
        """A snapshot in flight, sent or committed (in this lineage) already holds ``version``: a new one would duplicate it.

        When it must reach the root (``reaching_root``; None: when a pending request must),
        a snapshot for the local tier alone does not count.
        """
        root = self.p.requests.needs_root() if reaching_root is None else reaching_root
        return (
            any(s.version == version and (s.reaches_root or not root) for s in self.s.snapshots)
            or version in self.p.dispatcher.sent_versions(reaching_root=root)
            or version in self.p.dispatcher.held_versions
        )

    def busy_reason(self) -> str:
        if self.s.snapshots:
            s = self.s.snapshots[0]
            return f"the checkpoint requested after step {s.requested_step} was still being copied (window {s.window})"
        return self.p.dispatcher.busy_reason()

    def wait_until_startable(self) -> None:
        """Distributed: block this hook until a slot is free (and, for "auto", the agreed window is known).

        Ranks receive their writers' answers at different steps, so starting a request
        "as soon as a slot frees" would start it at different versions on different
        ranks. Every rank instead closes what is open at this same step and waits: a
        stall, but the same snapshot everywhere. Size ``every`` (or ``max_inflight``) so
        the previous checkpoint has committed by then, and it never waits.
        """
        must_drain = self.p.windows.tuner is not None and (self.s.snapshots or self.p.dispatcher.in_flight)
        if not must_drain and (len(self.p.slots.slots) < self.p.slots.max_inflight or any(not s.busy for s in self.p.slots.slots)):
            return
        started = time.perf_counter()
        # start_due=None: nothing starts inside this wait, not even on a replaced writer. The start that
        # waits goes on once it returns, at this same step; starting it inside the wait would hold this
        # hook until a checkpoint commits that needs the other ranks' collectives (issue 17).
        self.waits.drain(timeout_s=None, start_due=None)
        self.s.slot_wait_s += time.perf_counter() - started  # in the next snapshot's stats

    def _start_snapshot(
        self,
        slot: HostSlot,
        request: StartingRequest,
        layout: StateLayout,
        plan: CopyPlan,
        plan_id: int,
        choice: WindowChoice | None,
    ) -> None:
        s, mode = self.s.step_count, self.p.windows.mode_for(plan.window_steps)
        self.s.next_request_id += 1
        self.restarts.warn_about_late_hooks()
        planned = SnapshotPlan(layout=layout, plan=plan, plan_id=plan_id, choice=choice)
        snap = Snapshot.open(self.s.next_request_id, request, s, mode, slot, planned)
        snap.waited_for_slot_s, self.s.slot_wait_s = self.s.slot_wait_s, 0.0
        views = slot.entry_views(plan, layout)
        if mode == SnapshotMode.STAGE:
            for other in self.s.snapshots:  # the region is overwritten below: drain what still reads it
                if other.mode == SnapshotMode.STAGE:
                    self.p.copies.enqueue_remaining(other, self.s.step_count, self.s.hook_serial)
            # First, so that an over-budget staging area raises before the snapshot is registered.
            snap.staged_views = self.p.staging.stage(plan, layout, views)
        if mode == SnapshotMode.REPLAY:
            snap.replay_log = self.p.gradients.open(slot, plan, layout, base_step=s)
        slot.busy = True
        self.s.snapshots.append(snap)
        if self.pipelined.copies_in_batches(snap):
            snap.landing_batches = []  # copied in batches in slot order: it may go to the writer before they land
        self.p.copies.enqueue_group(snap, 0, self.s.step_count, self.s.hook_serial)
        if mode != SnapshotMode.REPLAY or snap.all_enqueued:
            # Window 1 and stage mode hold version s: every later group was staged above.
            self.p.copies.reach_version(snap, s)
