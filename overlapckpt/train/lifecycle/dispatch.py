"""The persist requests: what each sent snapshot asks the writer, what it answered, and what committed.

The dispatcher owns the training side of the writer link once a snapshot's bytes
are on the host: it builds the persist request (resolving the boundary values that
arrived with the copies), builds the snapshot's stats once, tracks what was sent,
completes the stats when the writer commits, frees the snapshot's host slot when
the writer answers, and keeps the first writer failure until the engine raises it.
It never blocks, except in ``wait_one``.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from ... import protocol as p
from ...errors import InternalError, OverlapCkptError, WriterDiedError, WritersRegroupedError
from ...format.key_layout import GET_STATE_DICT
from ...format.manifest import CheckpointInfo
from ...format.tiers import LOCAL_TIER, ROOT_TIER
from ...landing_page import apply_landed_figures
from ..consistency.boundary import resolve_boundary, resolve_values
from ..consistency.snapshot import Snapshot, SnapshotState, SnapshotStats
from ..copying.landing import LandedFigures
from ..copying.replay_tables import replay_tables
from ..copying.slots import SlotPool
from ..run.lineage import Lineage
from ..writer_client.client import WriterClient, writer_error
from ..writer_client.link import WriterLink

log = logging.getLogger("overlapckpt.commits")


class ReplayProgress(enum.Enum):
    """How far the writer got with a sent replay snapshot's in-place replay (``ReplayProgressNotice``)."""

    NOT_STARTED = "not-started"  # the slot holds the copied groups as the log expects them
    STARTED = "started"  # some groups may have been stepped: the slot is neither the copy nor the version
    FINISHED = "finished"  # the slot holds the version: persisted again, it is not replayed again


@dataclass
class _Sent:
    snapshot: Snapshot
    stats: SnapshotStats
    request: p.PersistRequest  # kept: a new writer persists it again if this one dies
    sent_at_s: float = field(default_factory=time.monotonic)
    replay: ReplayProgress = ReplayProgress.NOT_STARTED


@dataclass(frozen=True)
class PersistOptions:
    """What every persist request of a run asks of the writer, besides the snapshot itself."""

    keep: int | None = None  # the root's retention: checkpoints kept (None: all)
    local_keep: int | None = None  # the local tier's retention
    export_formats: tuple[str, ...] = ()
    key_layout: str = GET_STATE_DICT
    optimizer: str | None = None  # the optimizer class(es) by full name, for the manifest


class PersistDispatcher:
    """Sent snapshots, committed stats, and the first writer error."""

    def __init__(
        self,
        link: WriterLink,
        slots: SlotPool,
        lineage: Lineage,
        options: PersistOptions,
        on_commit: Callable[[dict[str, Any]], None] | None = None,
        unsolicited_errors: bool = False,
    ) -> None:
        self.options = options
        self.lineage = lineage
        self.on_commit = on_commit
        # Figures of something other than a commit (a restore's), handed to on_commit with the next commit's.
        self.figures_for_next_commit: dict[str, Any] = {}
        self.link = link
        link.on_replaced(self._hand_to)
        # Distributed: the writer may report, unasked, that other ranks claimed a checkpoint
        # this rank did not; the pipe is then read at every hook (~13 us), not only when due.
        self.unsolicited_errors = unsolicited_errors
        self.slots = slots
        self.stats: list[SnapshotStats] = []  # committed checkpoints, in commit order
        # Versions this run's current lineage committed: a new snapshot of one would duplicate it.
        # A restore starts a new lineage and clears them (its versions are to be taken again).
        self.held_versions: set[int] = set()
        self._sent: dict[int, _Sent] = {}
        self._unreturned: list[CheckpointInfo] = []
        self.error: OverlapCkptError | None = None
        self.lost_to_regroup = 0  # checkpoints a distributed run lost to a writer's replacement
        self.lost_mid_replay = 0  # checkpoints whose writer died while it replayed them in place
        # window="auto" in a distributed run: what the writers agreed, until the engine takes it (take_agreed_window).
        self._agreed_window: int | None = None
        self._fetch_ids = itertools.count(-1, -1)  # a restore's fetches: negative, so never a snapshot's request id

    def take_agreed_window(self) -> int | None:
        """The window the writers agreed for the next checkpoint since the last call (distributed ``window="auto"``), or None."""
        agreed, self._agreed_window = self._agreed_window, None
        return agreed

    @property
    def in_flight(self) -> int:
        return len(self._sent)

    def send(self, snap: Snapshot, proposed_next_window: int | None = None, landing_buffer_id: int | None = None) -> SnapshotStats:
        """Queue the persist request of a snapshot whose copies have all landed.

        ``landing_buffer_id``: pipelined (``pipelined_persist.py``), its copies still landing; the
        landing page with that id tells the writer how far, and ``landed`` completes its figures.
        """
        for g in snap.ledger.groups:
            landed = [t.landed_at_s or 0.0 for t in snap.tickets if t.group_index == g.index]
            if landed and landing_buffer_id is None:
                g.landed_s = max(landed) - snap.ledger.requested_at
        if snap.boundary is None:  # checked before anything is marked sent
            raise InternalError(f"the snapshot of step {snap.version} was sent before its boundary state was captured")
        snap.ledger.mark_complete()
        snap.state = SnapshotState.SENT
        stats = snap.stats()
        stats.writer_restarts = self.link.restarts.count  # before the request's copy of the stats is made
        stats.pipelined = landing_buffer_id is not None
        small_state, extra_state = resolve_boundary(snap.boundary)
        replay = snap.replay_log
        if replay is not None:
            for step in replay.steps:
                step.hyperparameters = resolve_values(step.hyperparameters)
        request = p.PersistRequest(
            request_id=snap.request_id,
            buffer_id=snap.slot.buffer_id,
            plan_id=snap.plan_id,
            name=self.lineage.name_for(snap.version),  # type: ignore[arg-type]
            step=snap.version,  # type: ignore[arg-type]
            requested_step=snap.requested_step,
            mode=snap.mode.value,
            window=snap.window,
            small_state=small_state,
            extra_state=extra_state,
            ledger=snap.ledger.to_json(),
            stats=_stats_json(stats),
            keep=self.options.keep,
            run_id=self.lineage.run_id,
            restored_from=self.lineage.restored_from,
            ancestors=tuple(self.lineage.ancestors),
            replay=replay,
            proposed_next_window=proposed_next_window,
            root_leased=self.lineage.root_leased,
            export_formats=self.options.export_formats,
            key_layout=self.options.key_layout,
            optimizer=self.options.optimizer,
            tiers=snap.tiers,
            local_keep=self.options.local_keep,
            landing_buffer_id=landing_buffer_id,
        )
        self._sent[snap.request_id] = _Sent(snap, stats, request)
        self.link.writer.send(request)
        return stats

    def landed(self, request_id: int, figures: LandedFigures) -> None:
        """A pipelined snapshot's copies all landed: its figures, here and in the request a new writer would get.

        From the landing publisher's thread, before it tells the writer (which answers only after).
        """
        sent = self._sent.get(request_id)
        if sent is None:
            return  # lost with its writer (a distributed regroup): nothing left to complete
        sent.stats.copy_s = figures.copy_s
        sent.stats.copied_nbytes = figures.copied_nbytes
        ledger = sent.snapshot.ledger
        for g in ledger.groups:
            g.landed_s = figures.landed_after_request_s
        ledger.complete_s = figures.landed_after_request_s
        # Patched in place, as the writer patches its copy (writer/slot_landing.py): a writer that
        # replaces a dead one persists this request with the same figures.
        apply_landed_figures(sent.request.stats, sent.request.ledger, figures.copy_s, figures.copied_nbytes, figures.landed_after_request_s)

    def poll(self) -> None:
        """Handle every answer that has arrived; never blocks."""
        if not self._sent and not self.link.writer.awaiting_responses and not self.unsolicited_errors:
            # Nothing is due: a liveness check (one waitpid) instead of reading the pipe.
            try:
                self.link.writer.check_alive()
            except OverlapCkptError as e:
                self.fail(e)
            return
        try:
            responses = self.link.writer.poll()
        except OverlapCkptError as e:
            self.fail(e)
            return
        for response in responses:
            self._handle(response)

    def wait_one(self, timeout_s: float | None) -> None:
        """Block for the writer's next answer (up to ``timeout_s``) and handle it."""
        try:
            response = self.link.writer.wait_response(timeout_s)
        except WriterDiedError as e:
            self.fail(e)
            return
        self._handle(response)

    def fetch_replicas(self, name: str, copies: tuple[p.FileCopy, ...], run_id: str, timeout_s: float) -> int:
        """At a restore (nothing in flight): the writers copy ``name``'s files a node lacks from partner nodes; bytes received."""
        request_id = next(self._fetch_ids)
        self.link.writer.send(p.FetchFilesRequest(request_id=request_id, name=name, copies=copies, run_id=run_id))
        while True:
            response = self.link.writer.wait_response(timeout_s)
            if isinstance(response, p.FetchedResponse) and response.request_id == request_id:
                return response.nbytes
            if isinstance(response, p.ErrorResponse) and response.request_id == request_id:
                raise writer_error(response, f"fetching checkpoint {name}'s files from partner nodes")
            self._handle(response)

    def busy_reason(self) -> str:
        """Why no host slot is free, for the deferral warning: the oldest checkpoint still persisting."""
        if not self._sent:
            return "no host slot was free"
        oldest = min(self._sent.values(), key=lambda s: s.sent_at_s)
        return (
            f"the checkpoint of step {oldest.snapshot.version} was still persisting (sent "
            f"{time.monotonic() - oldest.sent_at_s:.2f} s earlier); pass a larger max_inflight (one host copy of "
            "the state each) or checkpoint less often"
        )

    def sent_names(self) -> list[str]:
        """The checkpoints sent to the writer and not yet answered."""
        return [sent.request.name for sent in self._sent.values()]

    def sent_versions(self, reaching_root: bool = False) -> list[int | None]:
        """The versions of the snapshots sent and not yet answered (``reaching_root``: only those that go to the root)."""
        return [sent.snapshot.version for sent in self._sent.values() if sent.snapshot.reaches_root or not reaching_root]

    def take_committed(self) -> list[CheckpointInfo]:
        out, self._unreturned = self._unreturned, []
        return out

    def _hand_to(self, writer: WriterClient) -> None:
        """A new writer replaced a dead one: persist again what the dead one held (complete in host memory).

        First what the dead one said before it died and nobody read: a commit is a commit,
        and a replay it began decides what its successor may persist.
        """
        for response in self.link.last_words:
            self._handle(response)
        self.link.last_words = []
        self.error = None
        if self.link.distributed:
            # The other ranks lost this checkpoint with the writers' group (WritersRegroupedError):
            # persisting this rank's share alone could never commit.
            for sent in self._sent.values():
                sent.snapshot.slot.busy = False
                self.lost_to_regroup += 1
                log.warning("the checkpoint of step %s was lost with this rank's writer; the next one commits", sent.snapshot.version)
            self._sent.clear()
            return
        for request_id, sent in list(self._sent.items()):
            snap = sent.snapshot
            if sent.replay == ReplayProgress.STARTED:
                # Some of its groups may have been stepped in place, others not: replayed again
                # they would be stepped twice, and left as they are the slot is no version at all.
                del self._sent[request_id]
                snap.slot.busy = False
                self.lost_mid_replay += 1
                log.warning(
                    "the checkpoint of step %s was lost: its writer died while replaying it into host memory; "
                    "the next one commits", snap.version,
                )
                continue
            if sent.replay == ReplayProgress.FINISHED:
                # The slot holds the version already: persist it as it is.
                sent.request = dataclasses.replace(sent.request, replay=None)
                sent.replay = ReplayProgress.NOT_STARTED
            sent.stats.writer_restarts = self.link.restarts.count
            sent.request.stats["writer_restarts"] = self.link.restarts.count  # what its manifest records
            tables = replay_tables(snap.plan, snap.layout) if snap.plan.window_steps > 1 else None  # a new writer: rare
            writer.send(p.SetPlanRequest(snap.plan_id, snap.layout.entries, snap.plan.offsets, snap.layout.global_shapes, tables))
            writer.send(sent.request)

    def drop_all(self) -> None:
        """The writer died: what was sent is lost with it."""
        self._sent.clear()

    def _handle(self, response: object) -> None:
        if isinstance(response, p.MappedResponse):
            return  # counted by the writer link; the buffer is shared from now on
        if isinstance(response, p.ReplayProgressNotice):
            progressed = self._sent.get(response.request_id)
            if progressed is not None:
                progressed.replay = ReplayProgress.FINISHED if response.finished else ReplayProgress.STARTED
            return
        if isinstance(response, p.CommittedResponse):
            sent = self._sent.pop(response.request_id, None)
            if sent is None:
                return
            sent.snapshot.slot.busy = False
            stats = sent.stats
            stats.time_to_commit_s = response.committed_at - sent.snapshot.requested_wall_s
            stats.committed_at_unix_s = response.committed_at
            stats.persist_s = response.persist_s
            stats.persist_phases_s = dict(response.phases_s)
            stats.ledger = sent.snapshot.ledger.to_json()
            stats.path = response.info.path
            stats.tier_paths = dict(response.tier_paths)
            stats.writer_round_nodes = response.round_node_count
            if response.agreed_next_window is not None:
                self._agreed_window = response.agreed_next_window
            self.stats.append(stats)
            # A version the local tier alone holds is not held: a request() for it still reaches the root.
            if stats.step is not None and (ROOT_TIER in response.tier_paths or not response.tier_paths):
                self.held_versions.add(stats.step)
            self._unreturned.append(response.info)
            self._report_commit(stats, response)
        elif isinstance(response, p.ErrorResponse):
            sent = self._sent.pop(response.request_id, None) if response.request_id is not None else None
            if sent is not None:
                sent.snapshot.slot.busy = False
            if isinstance(response.exception, WritersRegroupedError):
                # Another rank's writer died and was replaced: this checkpoint is lost on every
                # rank, never listed; training and later checkpoints go on.
                self.lost_to_regroup += 1
                log.warning("%s", response.message)
                return
            what = (
                f"the writer failed to persist the checkpoint of step {sent.snapshot.version}"
                if sent is not None
                else "the writer failed"
            )
            self.fail(writer_error(response, what))

    def _report_commit(self, stats: SnapshotStats, response: p.CommittedResponse) -> None:
        """Log the commit, its retention and post-commit warnings; hand the figures to ``on_commit``."""
        log.info(
            "committed version %s (requested after step %d, %s, window %d): %.1f MiB, hooks %.2f ms, "
            "copies %.3f s, time to commit %.2f s",
            stats.step,
            stats.requested_step,
            stats.mode,
            stats.window,
            stats.nbytes / 2**20,
            stats.hook_host_s * 1e3,
            stats.copy_s,
            stats.time_to_commit_s or 0.0,
        )
        # Which tier's retention removed it: the one whose checkpoint of this commit sits beside it.
        local_parent = os.path.dirname(response.tier_paths.get(LOCAL_TIER, "").rstrip("/"))
        for name in response.removed:
            in_local = bool(local_parent) and os.path.dirname(name.rstrip("/")) == local_parent
            log.info("retention (%s=%s) removed %s", *(("local_keep", self.options.local_keep) if in_local else ("keep", self.options.keep)), name)
        for text in response.warnings:
            log.warning("%s", text)
        figures = {**commit_figures(stats), **self.figures_for_next_commit}
        self.figures_for_next_commit = {}
        if self.on_commit is not None:
            try:
                self.on_commit(figures)
            except Exception:  # a metrics sink must not fail the checkpoint it reports
                log.exception("on_commit raised for the checkpoint of step %s; the checkpoint is committed", stats.step)

    def fail(self, error: OverlapCkptError) -> None:
        """Keep the first error until the engine raises it (or replaces a dead writer)."""
        if self.error is None:
            self.error = error


def commit_figures(stats: SnapshotStats) -> dict[str, Any]:
    """One commit's figures for metrics sinks: flat, numeric where it can be, units in the names."""
    return {
        "step": stats.step,
        "requested_step": stats.requested_step,
        "mode": stats.mode,
        "window_steps": stats.window,
        "state_bytes": stats.nbytes,
        "copied_bytes": stats.copied_nbytes,
        "copy_s": stats.copy_s,
        "hook_host_s": stats.hook_host_s,
        "device_waits_in_flight": stats.device_waits_in_flight,
        "waited_for_slot_s": stats.waited_for_slot_s,
        "deferred": stats.deferred,
        "persist_s": stats.persist_s,
        # The writer's split of persist_s, flat: persist_write_s, persist_write_fsync_s, ...
        **{f"persist_{phase.replace('.', '_')}_s": seconds for phase, seconds in stats.persist_phases_s.items()},
        "time_to_commit_s": stats.time_to_commit_s,
        "committed_at_unix_s": stats.committed_at_unix_s,
        "writer_restarts": stats.writer_restarts,
        "writer_round_nodes": stats.writer_round_nodes,
        "path": stats.path,
    }


def _stats_json(stats: SnapshotStats) -> dict[str, object]:
    return {k: v for k, v in asdict(stats).items() if v is not None and k != "ledger"}

