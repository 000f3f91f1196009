"""The snapshot engine: the order of events in the optimizer's step and the loop's calls.

Per event (host work only: enqueue copies, insert fences, poll events):

* our pre-hook of step t+1 (first of all pre-hooks): if another pre-hook follows,
  fence the copies now, before it may write the state (``step_hooks.py``).
* the update point of step t+1 (right before the update, after the closure):
  fence the copies enqueued after step t (the compute stream waits on their
  events before the optimizer mutates the state), log the gradients and
  hyperparameters replay needs, close boundaries the user did not mark, and hand
  landed snapshots to the writer.
* post-hook of step t+1: fence the gradient copies of the update point; advance
  every snapshot (copy the group due now, or drain a staged group); start a
  requested snapshot at this version; capture the provisional boundary state.
* ``ckpt.step()`` (end of the iteration): capture the boundary state again for
  snapshots whose version was just reached.

Each mechanism has one owner: ``StepPoint`` (where the hooks sit), ``RequestQueue``
(pending, deferred and merged requests), ``WriterLink`` (the writer process and its
replacement), ``StagingArea``, ``GradientLogger``, ``PersistDispatcher`` (sent
snapshots and answers), ``PlanCache``, ``SlotPool``, ``SnapshotCopies`` and the
copier (the ``Copier`` protocol of ``copying/transfer.py``). The units are assembled in
``engine_parts.py``. The engine is the one orchestrator of four collaborators, one concern
each: starting snapshots (``starting.py``), sending them and reading the writer's answers
(``completion.py``), the restart rules (``snapshot_restarts.py``) and the blocking calls
(``blocking.py``). None holds another to start a snapshot: completion answers whether a
dead writer was replaced, and starts on the new one only what the engine hands it. Snapshot states
are described in ``consistency/snapshot.py``.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ...errors import InternalError, OverlapCkptError
from ...format.manifest import CheckpointInfo
from ...settings import CheckpointerSettings
from ..consistency.autowindow import FWD_BWD_END, FWD_BWD_START, OPT_END, OPT_START
from ..consistency.snapshot import SnapshotMode, SnapshotState
from .blocking import BlockingCalls
from .completion import SnapshotCompletion
from .engine_parts import BuiltUnits, RunCallbacks, assemble_parts
from .landing_watch import LandingWatch
from .pipelined_persist import PipelinedPersist
from .snapshot_restarts import SnapshotRestarts
from .starting import SnapshotStarts
from .step_hooks import StepPoint


def _counts_host_time(hook: Callable[..., None]) -> Callable[..., None]:
    """Adds the hook's whole host time, ours from entry to return, to ``EngineState.hook_host_total_s``.

    The figure the training loop waits for: on a GPU the copies are asynchronous, this is
    not (benchmarks/hook_scaling.py reads it per step).
    """

    @functools.wraps(hook)
    def timed(self: SnapshotEngine, *args: Any) -> None:
        started, started_cpu = time.perf_counter(), time.thread_time()
        try:
            with self.lock:  # the landing watch runs its completion step only between hooks
                hook(self, *args)
                # A snapshot now waiting only for its copies: sent as they land, even if no hook follows soon.
                self.landing_watch.note(self.completion.landing_tickets())
        finally:
            self.state.hook_host_total_s += time.perf_counter() - started
            self.state.hook_cpu_total_s += time.thread_time() - started_cpu

    return timed


class SnapshotEngine:
    """Drives snapshots from the optimizer's step hooks, through its four collaborators (``engine_parts.py``)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        settings: CheckpointerSettings,
        *,
        stateful: dict[str, Any],
        units: BuiltUnits,
        callbacks: RunCallbacks,
    ) -> None:
        # The options come as the one checked record (settings.py); ``units`` are what the
        # builder made, which the engine uses but does not own.
        step_point = StepPoint(optimizer, self._on_step_start, self._before_update, self._on_step_end)
        self.parts = assemble_parts(model, optimizer, stateful, settings, units, step_point, callbacks.on_commit)
        p = self.parts
        # The collaborators, each given what it calls (engine_parts.py): the calls go one way.
        # Completion only answers whether a dead writer was replaced; the engine starts what is pending.
        self.restarts = SnapshotRestarts(p)
        # Window-1 snapshots sent while their copies land, their landing published to the writer.
        self.pipelined = PipelinedPersist(p.copier, p.slots, p.dispatcher, p.distributed)
        self.completion = SnapshotCompletion(p, self.pipelined)
        self.blocking = BlockingCalls(p, self.completion)
        self.starts = SnapshotStarts(p, self.blocking, self.restarts, self.pipelined)
        # Held by every hook and blocking call, and by the landing watch while it hands a snapshot over.
        self.lock = threading.RLock()
        self.landing_watch = LandingWatch(self.lock, p.copier.await_landing, self.completion.send_landed, self._watch_failed)
        self.state = p.state
        # Called at each iteration boundary (save on a preemption signal); see preemption.py.
        self.at_boundary = callbacks.at_boundary
        step_point.install()
        if optimizer.state:  # the state exists (a warm start): allocate now, before any step
            self.starts.prepare()

    # ---- hooks (the order inside optimizer.step(): step_hooks.py) ----------------

    @_counts_host_time
    def _on_step_start(self, others_follow: bool) -> None:
        """Our pre-hook, first of all pre-hooks: fence here only if another pre-hook may mutate state next."""
        p, s = self.parts, self.state
        if s.dead is not None:
            return
        # The step runs on the stream current here: copies order against it, even those a
        # request() made outside the loop's stream context starts.
        p.copier.note_training_stream()
        self.restarts.note_grad_scaler()
        if not others_follow:
            return
        started = time.perf_counter()
        # Another pre-hook runs before the update point and may write parameters or
        # optimizer state in place: the copies reading them are fenced before it runs.
        self.fence_copies()
        p.replay_guard.record(s.snapshots)
        s.charge(started)

    def fence_copies(self) -> None:
        """Fence 2, now, for every copy enqueued by an earlier hook (idempotent)."""
        p, s = self.parts, self.state
        if s.dead is not None:
            return
        s.hook_serial += 1
        for snap in s.snapshots:
            p.copies.fence_earlier_copies(snap, s.hook_serial)
        self.pipelined.fence(p.copies, s.hook_serial)  # a sent snapshot's copies may still read the state

    @_counts_host_time
    def _before_update(self) -> None:
        """Right before the update (after the closure, clipping and every pre-hook): fence, log gradients."""
        p, s = self.parts, self.state
        if s.dead is not None:
            return
        p.copier.note_training_stream()
        if p.gap_timer is not None:
            # Before any fence below: forward+backward ends here, our waits are not part of it.
            p.gap_timer.mark(FWD_BWD_END)
        started = time.perf_counter()
        s.hook_serial += 1
        # GradScaler's fused path was noted in our pre-hook: it sets found_inf before step() runs.
        mutated_by = p.replay_guard.mutated()
        if mutated_by:
            self.restarts.replay_cannot_follow(mutated_by)
        self.pipelined.fence(p.copies, s.hook_serial)  # the update writes what a sent snapshot's copies may still read
        for snap in list(s.snapshots):
            p.copies.fence_earlier_copies(snap, s.hook_serial)
            if snap.state == SnapshotState.AT_BOUNDARY:
                s.close_boundary(snap, provisional=True)
            if snap.mode == SnapshotMode.REPLAY and snap.version is None:
                p.copies.log_gradients(snap, s.step_count + 1, s.hook_serial)
        s.charge(started)  # before sending: a snapshot sent below carries this hook's time
        self.completion.progress()
        if p.gap_timer is not None:
            p.gap_timer.mark(OPT_START)
        self.completion.settle(start_due=None)  # nothing starts in the update point: the post-hook starts it

    @_counts_host_time
    def _on_step_end(self, update_point_ran: bool) -> None:
        p, s = self.parts, self.state
        if s.dead is not None:
            s.step_count += 1
            if self.at_boundary is not None and not s.user_marks_boundary:
                self.at_boundary()  # a preemption signal must still end the process
            return
        p.copier.note_training_stream()
        if p.gap_timer is not None:
            # Before the fence below: the optimizer step ends here, the wait on the gradient copy is ours.
            p.gap_timer.mark(OPT_END)
        started = time.perf_counter()
        if not update_point_ran:
            self.restarts.update_point_skipped()
        s.hook_serial += 1
        s.step_count += 1
        self.restarts.note_grad_scaler()
        self.restarts.restart_if_state_grew()
        self.pipelined.fence(p.copies, s.hook_serial)
        for snap in s.snapshots:
            p.copies.fence_earlier_copies(snap, s.hook_serial)  # the gradient copies logged before this update
            if not snap.all_enqueued:
                p.copies.advance(snap, s.step_count, s.hook_serial)
        for version in p.schedule.opening(s.step_count, self.starts.lead_steps()):
            p.requests.add(s.step_count, scheduled_version=version)
        if s.prepared_fingerprint is None:
            self.starts.prepare()  # the first step created the optimizer state: its size is known now
        self.starts.start_pending()
        s.charge(started)
        self.completion.progress()
        if p.gap_timer is not None:
            # Last, after our own copies and clones: what follows is the next iteration.
            p.gap_timer.mark(FWD_BWD_START)
        self.completion.settle(self.starts.start_pending)
        if self.at_boundary is not None and not s.user_marks_boundary:
            self.at_boundary()  # the loop marks no boundary of its own: the step's end is one

    @_counts_host_time
    def mark_iteration_end(self) -> None:
        """``ckpt.step()``: the boundary where stateful objects are captured."""
        p, s = self.parts, self.state
        if s.dead is not None:
            if self.at_boundary is not None:
                self.at_boundary()  # a preemption signal must still end the process
            return
        s.user_marks_boundary = True
        started = time.perf_counter()
        for snap in s.snapshots:
            if snap.state == SnapshotState.AT_BOUNDARY:
                p.copies.capture_boundary(snap)
                snap.state = SnapshotState.LANDING
                snap.ledger.boundary = "step()"
        s.charge(started)
        self.completion.progress()
        self.completion.settle(self.starts.start_pending)
        if self.at_boundary is not None:
            self.at_boundary()

    @_counts_host_time
    def request(self) -> None:
        """Checkpoint the state of the last completed optimizer step, now or as soon as a slot frees."""
        p, s = self.parts, self.state
        if s.dead is not None:
            raise s.dead
        self.completion.settle(self.starts.start_pending)
        started = time.perf_counter()
        p.requests.add(s.step_count)
        self.starts.start_pending()
        s.charge(started)  # the copies a request starts are host time the loop waits for
        self.completion.progress()
        self.completion.settle(self.starts.start_pending)

    # ---- blocking calls and their answers ------------------------------------------------

    def wait(self, timeout_s: float | None) -> list[CheckpointInfo]:
        """Finish every requested snapshot now and block until the writer committed each."""
        with self.lock:
            return self.blocking.wait(timeout_s, lambda: self.starts.start_pending(closing=True))

    def abandon(self, timeout_s: float) -> list[CheckpointInfo]:
        with self.lock:
            return self.blocking.abandon(timeout_s)

    def _watch_failed(self, error: BaseException) -> None:
        """The landing watch's unexpected error: raised in the training thread at its next hook."""
        if self.parts.dispatcher.error is None:
            if not isinstance(error, OverlapCkptError):
                wrapped = InternalError(f"handing a landed snapshot to the writer failed: {type(error).__name__}: {error}")
                wrapped.__cause__ = error
                error = wrapped
            self.parts.dispatcher.error = error

    def covers_current_step(self) -> bool:
        """Whether a snapshot that goes to the root holds the current step, or will once an open replay window closes now.

        A preemption's checkpoint must reach the root too: one for the local tier alone does not cover it.
        """
        s = self.state
        open_replay = any(snap.mode == SnapshotMode.REPLAY and snap.version is None and snap.reaches_root for snap in s.snapshots)
        return open_replay or self.starts.holds_version(s.step_count, reaching_root=True)

    def continue_from(self, step: int) -> None:
        """After a restore: the next update makes version ``step + 1``; of the versions, only ``step`` is held (restored)."""
        self.state.step_count = step
        self.parts.schedule.continue_from(step)
        # A request before the next update would duplicate the checkpoint just restored
        # (a framework's final save after a resume that trained nothing).
        self.parts.dispatcher.held_versions = {step}

    def shut_down(self, writer_timeout_s: float) -> None:
        """Remove the hooks, stop the landing watch and the writer, release host buffers (after the copies into them)."""
        self.parts.step_point.remove()
        self.landing_watch.close()
        # The writer may be writing a pipelined snapshot: its landing is published until the writer exits.
        self.parts.link.close(timeout_s=writer_timeout_s)
        self.pipelined.close()
        self.release()

    def release(self) -> None:
        # Teardown may come with copies still queued (the writer died, wait() raised):
        # the copy engine must be done writing host memory before it is unpinned and unmapped.
        p = self.parts
        p.copier.close()
        p.staging.release()
        p.gradients.release()
        p.slots.release_all()
