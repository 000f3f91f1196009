"""The engine's side of completion, in every hook: which snapshots have landed, and what the writer's answers mean for them.

Nothing here blocks: ``progress`` runs in every hook, hands the snapshots whose copies
have landed to the dispatcher (``dispatch.py`` builds and tracks their requests), then
has it read whatever answers arrived. Errors are raised from ``settle`` at the end of a
hook, once the hook's own work is done; a dead writer is replaced there
(``writer_client/link.py``) while the restart budget lasts, and what the caller hands
``settle`` starts on the new one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ...errors import WriterDiedError
from ..consistency.snapshot import SnapshotMode, SnapshotState
from ..copying.transfer import CopyTicket
from ..warnings_text import WRITER_RESTART_WARNING
from .pipelined_persist import PipelinedPersist

if TYPE_CHECKING:
    from .engine_parts import EngineParts


class SnapshotCompletion:
    """Handing landed snapshots to the writer and reading its answers; a dead writer's replacement."""

    def __init__(self, parts: EngineParts, pipelined: PipelinedPersist) -> None:
        self.p = parts
        self.s = parts.state
        self.pipelined = pipelined

    def progress(self) -> None:
        """Hand landed snapshots to the writer and read its answers. Never blocks."""
        self.send_landed()
        self.p.dispatcher.poll()
        agreed = self.p.dispatcher.take_agreed_window()
        if agreed is not None:  # held by the window policy alone from here on
            self.p.windows.agreed_window = agreed

    def send_landed(self) -> None:
        """Hand landed snapshots to the writer (the landing watch's step too: it reads no answers, so
        ``on_commit`` is only ever called from the training thread). A dead writer is noted, raised later."""
        try:
            self._send_landed()
        except WriterDiedError as e:
            self.p.dispatcher.fail(e)  # what was sent is persisted again by a new writer

    def landing_tickets(self) -> list[CopyTicket]:
        """The copies of the snapshots waiting only for them to land: what the landing watch waits for."""
        return [t for snap in self.s.snapshots if snap.state == SnapshotState.LANDING and snap.all_enqueued for t in snap.tickets]

    def _send_landed(self) -> None:
        if self.p.slots.preallocation_done():
            self.p.slots.finish_preallocation()  # announce the buffers a background thread allocated
        for snap in list(self.s.snapshots):
            # Every ticket, in every hook, not only once the window is complete: each clone a
            # copy read (replay's gradients) is freed when its own copy lands. Held until the
            # window landed, a replay window's clones would add up to (W-1)/2 x the parameters.
            landed = [self.p.copier.poll(t) for t in snap.tickets]
            if snap.state != SnapshotState.LANDING or not snap.all_enqueued:
                continue
            if all(landed):
                self.s.snapshots.remove(snap)
                snap.staged_views = []  # its drains landed: nothing of it reads the staging region any more
                proposal = self.p.windows.propose(self.p.plans, self.p.staging, snap.layout)
                stats = self.p.dispatcher.send(snap, proposed_next_window=proposal)
                if snap.mode == SnapshotMode.STAGE:
                    self.p.staging.forget_landed_drains()
                self.p.windows.observe_copies(stats.copied_nbytes, stats.copy_s)
            elif self.pipelined.may_send_early(snap, landed):
                # Its boundary is final and its batches are queued: the writer starts now and writes
                # each entry once it landed (pipelined_persist.py), which owns its tickets from here on.
                self.s.snapshots.remove(snap)
                proposal = self.p.windows.propose(self.p.plans, self.p.staging, snap.layout)
                self.pipelined.send_early(snap, proposal)
        for figures in self.pipelined.take_landed():
            self.p.windows.observe_copies(figures.copied_nbytes, figures.copy_s)

    def _raise_pending(self) -> bool:
        """Raise the writer's error; True when it was a dead writer, now replaced (nothing raised).

        What follows a replacement is ``settle``'s: what its caller hands it starts (a request
        the death interrupted, at this same step), then the answers are read again and this is
        called again, until no error is left.
        """
        error, self.p.dispatcher.error = self.p.dispatcher.error, None
        if error is None:
            return False
        if isinstance(error, WriterDiedError):
            if self.replace_dead_writer(error):
                return True
            # In-flight snapshots are gone with the writer; their slots are unusable.
            self.s.dead = error
            self.s.snapshots.clear()
            self.p.dispatcher.drop_all()
        raise error

    def settle(self, start_due: Callable[[], None] | None) -> None:
        """Raise the writer's error, or replace a dead writer and go on (``start_due``: what starts on its replacement).

        ``start_due`` is None where nothing may start. Right before the update: this hook
        has logged the step's gradients and fenced its copies already, so a replay snapshot
        started there would miss this step's gradients (a wrong checkpoint listed, found by
        fault seed 50), and any snapshot's first copies would race the update; the post-hook
        starts it instead. In a hook's wait for a slot (``wait_for_free_slot``, and a distributed
        run's ``wait_until_startable``): the start that waits goes on once the wait returns, at
        this same step (issue 17: starting it inside the distributed wait would hold the hook
        until a checkpoint commits that needs the other ranks' collectives).
        """
        while self._raise_pending():
            if start_due is not None:
                start_due()
            self.progress()

    def replace_dead_writer(self, error: WriterDiedError) -> bool:
        """Start a new writer and hand it the host buffers, plans and complete snapshots; False if none may start."""
        if not self.p.link.replace():  # hands the new writer the buffers, plans and sent snapshots
            return False
        if not self.p.link.distributed:
            # Snapshots still being copied are dropped: their request may be made again. The
            # ones sent were complete in host memory and are persisted by the new writer.
            for snap in self.s.snapshots:
                self.p.slots.drop(snap.slot, snap.tickets)  # unmapped only once its queued copies landed
            self.s.snapshots_dropped += len(self.s.snapshots)
            self.s.snapshots.clear()
        # In a distributed run they go on to the new writer instead: this rank never sent
        # them, so no other rank can have lost them with the old group, and a request made
        # again would come at a later step than the other ranks' (they would disagree).
        self.s.warn_once("writer-restart", WRITER_RESTART_WARNING.format(error=error, limit=self.p.link.restarts.max_restarts))
        return True
