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
copier (``transfer.py``). The engine's other parts are mixins, one concern each:
starting snapshots (``starts.py``), sending them and reading the writer's answers
(``completion.py``), the restart rules (``restarts.py``) and the blocking calls
(``blocking.py``); snapshot states are described in ``snapshot.py``.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..errors import WriterDiedError
from ..format.key_layout import GET_STATE_DICT
from .autowindow import FWD_BWD_END, FWD_BWD_START, OPT_END, OPT_START, PhaseTimer
from .blocking import BlockingCalls
from .completion import SnapshotCompletion
from .dispatch import PersistDispatcher
from .gradlog import GradientLogger
from .layout import CheckpointScope
from .lineage import Lineage
from .optimizer_group import update_rule_name
from .plan_cache import PlanCache
from .replay_guard import ReplayMutationGuard
from .requests import CheckpointSchedule, RequestQueue
from .restarts import SnapshotRestarts
from .slots import SlotPool
from .snapshot import Snapshot, SnapshotMode, SnapshotState, SnapshotStats
from .snapshot_copies import SnapshotCopies
from .staging import StagingArea
from .starts import SnapshotStarts
from .step_hooks import StepPoint
from .transfer import Copier
from .warnings_text import (
    BOUNDARY_WARNING,
)
from .window_policy import WindowPolicy
from .writer_link import WriterLink


class SnapshotEngine(SnapshotStarts, SnapshotCompletion, BlockingCalls, SnapshotRestarts):
    """Drives snapshots from the optimizer's step hooks."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        window: int | str,
        consistency: str,
        every: int | None,
        keep: int | None,
        stateful: dict[str, Any],
        link: WriterLink,
        max_inflight: int,
        stage_budget_bytes: int | None,
        max_window: int,
        copier: Copier,
        gap_timer: PhaseTimer | None,
        scope: CheckpointScope,
        lineage: Lineage,
        at_boundary: Callable[[], None] | None = None,
        on_commit: Callable[[dict[str, Any]], None] | None = None,
        export_formats: tuple[str, ...] = (),
        key_layout: str = GET_STATE_DICT,
    ) -> None:
        self.optimizer = optimizer
        self.consistency = SnapshotMode(consistency)
        self.schedule = CheckpointSchedule(every)
        self.stateful = stateful
        self.link = link
        self.copier = copier
        self.gap_timer = gap_timer
        # Distributed: every rank must start each snapshot at the same step, so a request
        # that finds no free slot waits for one instead of starting later on some ranks.
        self.distributed = scope.world_size > 1
        self.windows = WindowPolicy(
            window, self.consistency, max_window, gap_timer, gradients_fenced=not copier.clone_is_cheap, distributed=self.distributed
        )
        self.slots = SlotPool(link, copier, max_inflight=max_inflight)
        self.plans = PlanCache(model, optimizer, link, scope, key_layout)
        self.staging = StagingArea(copier, stage_budget_bytes)
        self.gradients = GradientLogger(optimizer, copier)
        self.copies = SnapshotCopies(optimizer, stateful, copier, self.staging, self.gradients)
        self.dispatcher = PersistDispatcher(
            link, self.slots, keep, lineage, on_commit, unsolicited_errors=scope.world_size > 1, export_formats=export_formats,
            key_layout=key_layout, optimizer=update_rule_name(optimizer),
        )
        self.step_count = 0
        self._hook_serial = 0
        self._next_request_id = 0
        self._snapshots: list[Snapshot] = []  # started and not yet sent, in start order
        self.requests = RequestQueue()
        self._slot_wait_s = 0.0  # distributed: hook time the next snapshot waited for a free slot
        self._starting_pending = False  # inside _start_pending: a replaced writer does not start it again
        self._prepared_fingerprint: int | None = None
        self._user_marks_boundary = False
        self._warned: set[str] = set()
        self.dead: WriterDiedError | None = None  # set once a writer death has been raised
        self.snapshots_dropped = 0  # incomplete snapshots lost with a dead writer
        # Called at each iteration boundary (save on a preemption signal); see preemption.py.
        self.at_boundary = at_boundary
        self.step_point = StepPoint(optimizer, self._on_step_start, self._before_update, self._on_step_end)
        self._replay_guard = ReplayMutationGuard(self.step_point)
        self.install_hooks()
        if optimizer.state:  # the state exists (a warm start): allocate now, before any step
            self._prepare()

    def install_hooks(self) -> None:
        self.step_point.install()

    def remove_hooks(self) -> None:
        self.step_point.remove()

    # ---- hooks (the order inside optimizer.step(): step_hooks.py) ----------------

    def _on_step_start(self, others_follow: bool) -> None:
        """Our pre-hook, first of all pre-hooks: fence here only if another pre-hook may mutate state next."""
        if self.dead is not None:
            return
        # The step runs on the stream current here: copies order against it, even those a
        # request() made outside the loop's stream context starts.
        self.copier.note_training_stream()
        self._note_grad_scaler()
        if not others_follow:
            return
        started = time.perf_counter()
        # Another pre-hook runs before the update point and may write parameters or
        # optimizer state in place: the copies reading them are fenced before it runs.
        self.fence_copies()
        self._replay_guard.record(self._snapshots)
        self._charge(started)

    def fence_copies(self) -> None:
        """Fence 2, now, for every copy enqueued by an earlier hook (idempotent)."""
        if self.dead is not None:
            return
        self._hook_serial += 1
        for snap in self._snapshots:
            self.copies.fence_earlier_copies(snap, self._hook_serial)

    def _before_update(self) -> None:
        """Right before the update (after the closure, clipping and every pre-hook): fence, log gradients."""
        if self.dead is not None:
            return
        self.copier.note_training_stream()
        if self.gap_timer is not None:
            # Before any fence below: forward+backward ends here, our waits are not part of it.
            self.gap_timer.mark(FWD_BWD_END)
        started = time.perf_counter()
        self._hook_serial += 1
        # GradScaler's fused path was noted in our pre-hook: it sets found_inf before step() runs.
        mutated_by = self._replay_guard.mutated()
        if mutated_by:
            self._replay_cannot_follow(mutated_by)
        for snap in list(self._snapshots):
            self.copies.fence_earlier_copies(snap, self._hook_serial)
            if snap.state == SnapshotState.AT_BOUNDARY:
                self._close_boundary(snap, provisional=True)
            if snap.mode == SnapshotMode.REPLAY and snap.version is None:
                self.copies.log_gradients(snap, self.step_count + 1, self._hook_serial)
        self._charge(started)  # before sending: a snapshot sent below carries this hook's time
        self._progress()
        if self.gap_timer is not None:
            self.gap_timer.mark(OPT_START)
        self._raise_pending(may_start=False)

    def _on_step_end(self, update_point_ran: bool) -> None:
        if self.dead is not None:
            self.step_count += 1
            if self.at_boundary is not None and not self._user_marks_boundary:
                self.at_boundary()  # a preemption signal must still end the process
            return
        self.copier.note_training_stream()
        if self.gap_timer is not None:
            # Before the fence below: the optimizer step ends here, the wait on the gradient copy is ours.
            self.gap_timer.mark(OPT_END)
        started = time.perf_counter()
        if not update_point_ran:
            self._update_point_skipped()
        self._hook_serial += 1
        self.step_count += 1
        self._note_grad_scaler()
        self._restart_if_state_grew()
        for snap in self._snapshots:
            self.copies.fence_earlier_copies(snap, self._hook_serial)  # the gradient copies logged before this update
            if not snap.all_enqueued:
                self.copies.advance(snap, self.step_count, self._hook_serial)
        for version in self.schedule.opening(self.step_count, self._lead_steps()):
            self.requests.add(self.step_count, scheduled_version=version)
        if self._prepared_fingerprint is None:
            self._prepare()  # the first step created the optimizer state: its size is known now
        self._start_pending()
        self._charge(started)
        self._progress()
        if self.gap_timer is not None:
            # Last, after our own copies and clones: what follows is the next iteration.
            self.gap_timer.mark(FWD_BWD_START)
        self._raise_pending()
        if self.at_boundary is not None and not self._user_marks_boundary:
            self.at_boundary()  # the loop marks no boundary of its own: the step's end is one

    def mark_iteration_end(self) -> None:
        """``ckpt.step()``: the boundary where stateful objects are captured."""
        if self.dead is not None:
            if self.at_boundary is not None:
                self.at_boundary()  # a preemption signal must still end the process
            return
        self._user_marks_boundary = True
        started = time.perf_counter()
        for snap in self._snapshots:
            if snap.state == SnapshotState.AT_BOUNDARY:
                self.copies.capture_boundary(snap)
                snap.state = SnapshotState.LANDING
                snap.ledger.boundary = "step()"
        self._charge(started)
        self._progress()
        self._raise_pending()
        if self.at_boundary is not None:
            self.at_boundary()

    def request(self) -> None:
        """Checkpoint the state of the last completed optimizer step, now or as soon as a slot frees."""
        if self.dead is not None:
            raise self.dead
        self._raise_pending()
        started = time.perf_counter()
        self.requests.add(self.step_count)
        self._start_pending()
        self._charge(started)  # the copies a request starts are host time the loop waits for
        self._progress()
        self._raise_pending()

    # ---- boundaries, GradScaler, layout changes ---------------------------------------

    def _close_boundary(self, snap: Snapshot, provisional: bool) -> None:
        """Keep the boundary captured in the post-hook: ckpt.step() did not come."""
        snap.state = SnapshotState.LANDING
        snap.ledger.boundary = "post-hook"
        if provisional and not self._user_marks_boundary and self.stateful:
            self._warn_once("boundary", BOUNDARY_WARNING)

    def _warn_once(self, key: str, text: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(text, stacklevel=5)

    def _charge(self, started: float) -> None:
        """Add the host time since ``started`` to every snapshot in flight (``hook_host_s``)."""
        spent = time.perf_counter() - started
        for snap in self._snapshots:
            snap.hook_host_s += spent

    @property
    def stats(self) -> list[SnapshotStats]:
        """Committed checkpoints' figures, in commit order."""
        return self.dispatcher.stats

    @property
    def deferrals(self) -> int:
        return self.requests.deferrals

    @property
    def writer_pid(self) -> int:
        return self.link.writer.pid

    @property
    def writer_restarts(self) -> int:
        return self.link.restarts.count

    def continue_from(self, step: int) -> None:
        """After a restore: the next update makes version ``step + 1``; of the versions, only ``step`` is held (restored)."""
        self.step_count = step
        self.schedule.continue_from(step)
        # A request before the next update would duplicate the checkpoint just restored
        # (a framework's final save after a resume that trained nothing).
        self.dispatcher.held_versions = {step}

    def shut_down(self, writer_timeout_s: float) -> None:
        """Remove the hooks, stop the writer, release host buffers (after the copies into them)."""
        self.remove_hooks()
        self.link.close(timeout_s=writer_timeout_s)
        self.release()

    def release(self) -> None:
        # Teardown may come with copies still queued (the writer died, wait() raised):
        # the copy engine must be done writing host memory before it is unpinned and unmapped.
        self.copier.close()
        self.staging.release()
        self.gradients.release()
        self.slots.release_all()
