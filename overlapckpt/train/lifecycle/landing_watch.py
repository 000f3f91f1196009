"""Handing a landed snapshot to the writer while the loop is idle: the landing watch.

The hooks hand a snapshot to the writer once its copies have landed, at the next hook
that sees it. A loop that pauses after a checkpoint's step (evaluation, a data stall,
the last step before a long save) calls no hook, so a snapshot complete in host memory
waited there, unlisted, until the loop came back: a kill during the pause lost it. The
watch is one thread of the training process that waits, outside every lock, for the
copies of a snapshot the hooks have fully enqueued, then takes the engine's lock and
runs the same completion step a hook runs (``SnapshotCompletion.progress``). It never
waits in a way that hurries the device (``Copier.await_landing``), does no heavy work
(the request is a few hundred bytes on a pipe) and is stopped and joined at shutdown.

States:

    IDLE --note(tickets)--> WAITING --copies landed--> SENDING --progress() done--> IDLE
      \\______________________________ close() from any state ______________________/--> CLOSED
"""

from __future__ import annotations

import enum
import logging
import operator
import threading
from collections.abc import Callable, Sequence
from typing import Any

from ..copying.transfer import CopyTicket

log = logging.getLogger("overlapckpt.landing")

# How long one wait on a copy lasts before the watch checks whether it is closing.
AWAIT_SLICE_S = 0.5
# How long shutdown waits for the watch to finish the completion step it is in.
JOIN_TIMEOUT_S = 30.0


class WatchState(enum.Enum):
    IDLE = "idle"
    WAITING = "waiting"
    SENDING = "sending"
    CLOSED = "closed"


class LandingWatch:
    """One thread: waits for the tickets the hooks noted, then runs ``progress`` under ``lock``."""

    def __init__(
        self,
        lock: Any,
        await_landing: Callable[[CopyTicket, float], bool],
        progress: Callable[[], None],
        on_error: Callable[[BaseException], None],
    ) -> None:
        self._lock = lock  # the engine's: every hook holds it, so progress() never runs beside one
        self._await_landing = await_landing
        self._progress = progress
        self._on_error = on_error
        self._cv = threading.Condition()
        self._tickets: tuple[CopyTicket, ...] = ()
        self.state = WatchState.IDLE
        self._thread: threading.Thread | None = None

    def note(self, tickets: Sequence[CopyTicket]) -> None:
        """From a hook (holding the engine's lock): watch these tickets, replacing any watched before. Never blocks long."""
        with self._cv:
            if self.state is WatchState.CLOSED:
                return
            if len(tickets) == len(self._tickets) and all(map(operator.is_, tickets, self._tickets)):
                return  # the same snapshot still landing: the wait under way goes on
            self._tickets = tuple(tickets)
            if self._thread is None and self._tickets:
                # Started at the first snapshot, not at construction: a Checkpointer that never
                # checkpoints runs no thread.
                self._thread = threading.Thread(target=self._run, name="overlapckpt-landing-watch", daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def close(self) -> None:
        """Stop the thread and join it (it finishes a completion step it is in)."""
        with self._cv:
            self.state = WatchState.CLOSED
            self._tickets = ()
            self._cv.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(JOIN_TIMEOUT_S)
            if thread.is_alive():
                log.warning("the landing watch did not stop within %.0f s; it is a daemon thread and ends with the process", JOIN_TIMEOUT_S)

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self.state is WatchState.CLOSED or bool(self._tickets))
                if self.state is WatchState.CLOSED:
                    return
                tickets = self._tickets
                self.state = WatchState.WAITING
            if not self._landed(tickets):
                continue  # closing, or the hooks noted other tickets meanwhile
            with self._cv:
                if self.state is WatchState.CLOSED:
                    return
                if self._tickets is tickets:
                    self._tickets = ()
                self.state = WatchState.SENDING
            try:
                with self._lock:
                    self._progress()
            except BaseException as e:  # noqa: BLE001 - raised in the training thread at its next hook
                self._on_error(e)
            with self._cv:
                if self.state is WatchState.SENDING:
                    self.state = WatchState.IDLE

    def _landed(self, tickets: tuple[CopyTicket, ...]) -> bool:
        """Whether every ticket landed; False as soon as the watch closes or the hooks replaced the tickets."""
        for ticket in tickets:
            while not self._await_landing(ticket, AWAIT_SLICE_S):
                with self._cv:
                    if self.state is WatchState.CLOSED or self._tickets is not tickets:
                        return False
        return True
