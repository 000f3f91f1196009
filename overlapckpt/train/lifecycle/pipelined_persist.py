"""A pipelined persist: a window-1 snapshot sent to the writer while its copies still land.

Without it, a snapshot's persist request goes out once every copy of it has landed, and
the writer starts then: the copy and the write follow one another (a 768 MiB state on a
2-core VM: 0.13 s of copy, then 0.26 s of write to tmpfs). Here a window-1 snapshot is
copied in batches in slot order (``snapshot_copies.py``), and sent as soon as its boundary
is final, while the batches still run on the side stream. One thread of this process
(the publisher) then waits for each batch in turn and publishes, on the landing page
(``landing_page.py``), how many bytes of the slot hold the snapshot; the writer writes
each entry once they cover it, and commits only once every byte has landed.

A snapshot is pipelined only when nothing else is in flight (the page serves one at a
time), in a run of one process (a distributed run's writers agree on each checkpoint
first; not pipelined yet), where landing words can be ordered (``pipelining_supported``)
and when ``OVERLAPCKPT_PIPELINED_PERSIST`` is not ``0``. Its boundary values that travel
through the copier (a tensor lr, GradScaler's scale) must have landed: they go in the
request.

States of the publisher:

    PUBLISHING --every batch landed--> FINISHED (figures written, then ALL_LANDED)
        \\--a copy failed, or close() before the end--> ABANDONED (the writer refuses it)
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...landing_page import pipelining_supported
from ..consistency import snapshot_copies
from ..consistency.snapshot import Snapshot, SnapshotMode, SnapshotStats
from ..consistency.snapshot_copies import SnapshotCopies
from ..copying.landing import LandedFigures, OwnedLandingPage
from ..copying.transfer import Copier

if TYPE_CHECKING:
    from ..copying.slots import SlotPool
    from .dispatch import PersistDispatcher

log = logging.getLogger("overlapckpt.pipelined")

# "0": every snapshot is sent once all its copies landed (the benchmarks' "before").
PIPELINED_PERSIST_ENV = "OVERLAPCKPT_PIPELINED_PERSIST"
# How long one wait on a batch lasts before the publisher checks whether it is closing.
AWAIT_SLICE_S = 0.5
# How long close() waits for the publisher to finish the snapshot it publishes.
JOIN_TIMEOUT_S = 30.0


@dataclass
class _Publishing:
    snap: Snapshot
    stats: SnapshotStats
    page: OwnedLandingPage


class PipelinedPersist:
    """Which snapshots are copied in batches and sent early, and the thread that publishes their landing."""

    def __init__(
        self,
        copier: Copier,
        slots: SlotPool,
        dispatcher: PersistDispatcher,
        distributed: bool,
    ) -> None:
        self.copier = copier
        self.slots = slots
        self.dispatcher = dispatcher
        self.enabled = os.environ.get(PIPELINED_PERSIST_ENV, "1") != "0" and not distributed and pipelining_supported()
        self._current: _Publishing | None = None
        self._thread: threading.Thread | None = None
        self._closing = threading.Event()
        self._landed: list[LandedFigures] = []  # landed since the engine last took them (take_landed)

    def copies_in_batches(self, snap: Snapshot) -> bool:
        """At a snapshot's start: whether its copy goes in batches in slot order (it may be sent early)."""
        return (
            self.enabled
            and snap.mode == SnapshotMode.SINGLE_STEP
            and len(snap.plan.groups) == 1
            and snap.plan.groups[0].nbytes >= 2 * snapshot_copies.LANDING_BATCH_BYTES  # two batches at least
        )

    def may_send_early(self, snap: Snapshot, landed: list[bool]) -> bool:
        """Whether ``snap`` (its boundary final, every copy enqueued, not all landed) may go to the writer now.

        ``landed``: whether each of its tickets has landed, as the hook just polled them.
        """
        if snap.landing_batches is None or self.busy() or self.dispatcher.in_flight:
            return False
        # Boundary values copied through the copier go in the request: they must be on the host.
        return all(done for ticket, done in zip(snap.tickets, landed) if ticket.group_index is None)

    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def send_early(self, snap: Snapshot, proposed_next_window: int | None) -> SnapshotStats:
        """Send ``snap``'s request now and publish its batches as they land; from here on this unit owns its tickets."""
        page = self.slots.landing_page()
        page.open(snap.request_id)  # before the request: the writer reads the page once it has it
        stats = self.dispatcher.send(snap, proposed_next_window=proposed_next_window, landing_buffer_id=page.buffer_id)
        self._join_finished()
        self._current = _Publishing(snap, stats, page)
        self._thread = threading.Thread(target=self._publish, args=(self._current,), name="overlapckpt-landing-publisher", daemon=True)
        self._thread.start()
        return stats

    def fence(self, copies: SnapshotCopies, hook: int) -> None:
        """Fence 2 for the sent snapshot's copies (training thread): what they read is about to be mutated.

        Sent early, it is no longer among the engine's snapshots, whose hooks fence theirs; its
        fences count in its stats, as any snapshot's do.
        """
        job = self._current
        if job is None or not job.snap.unfenced:
            return
        copies.fence_earlier_copies(job.snap, hook)
        job.stats.device_waits_inserted = job.snap.device_waits_inserted
        job.stats.device_waits_in_flight = job.snap.device_waits_in_flight

    def take_landed(self) -> list[LandedFigures]:
        """The copies that finished landing since the last call: for the engine's window choice (training thread)."""
        landed, self._landed = self._landed, []
        return landed

    def close(self) -> None:
        """Stop publishing (a snapshot not fully landed is abandoned) and join the thread."""
        self._closing.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(JOIN_TIMEOUT_S)
            if thread.is_alive():
                log.warning("the landing publisher did not stop within %.0f s; it is a daemon thread and ends with the process", JOIN_TIMEOUT_S)

    def _join_finished(self) -> None:
        if self._thread is not None and not self._thread.is_alive():
            self._thread.join()
            self._thread = None

    def _publish(self, job: _Publishing) -> None:
        snap, page = job.snap, job.page
        try:
            assert snap.landing_batches is not None
            for ticket, landed_end in snap.landing_batches:
                while not self.copier.await_landing(ticket, AWAIT_SLICE_S):
                    if self._closing.is_set():
                        page.abandon()
                        return
                # Records the landing on this thread, which owns the sent snapshot's tickets: host
                # values the copy deferred to its landing are written into the slot here, before
                # the writer may read them.
                self.copier.poll(ticket)
                page.publish(landed_end)
            # Every ticket has landed now: the batches above, the boundary's before the send (may_send_early).
            figures = self._figures(snap)
            self.dispatcher.landed(snap.request_id, figures)  # before the page says so: no answer can come before
            self._landed.append(figures)
            page.finish(figures)
        except BaseException:  # noqa: BLE001 - the writer refuses the checkpoint, and the training thread raises its answer
            page.abandon()
            log.exception("the copies of the checkpoint of step %s failed while the writer wrote it; it is abandoned", snap.version)

    @staticmethod
    def _figures(snap: Snapshot) -> LandedFigures:
        landed_at = max(t.landed_at_s or 0.0 for t in snap.tickets)
        return LandedFigures(
            copy_s=sum(t.copy_s or 0.0 for t in snap.tickets),
            copied_nbytes=sum(t.nbytes for t in snap.tickets),
            landed_after_request_s=landed_at - snap.ledger.requested_at,
        )
