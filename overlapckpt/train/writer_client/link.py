"""The one owner of the writer process: the handle every unit sends through, its factory, the restart budget.

Host slots, plans and the dispatcher all talk to the writer through ``WriterLink.writer``;
none keeps a handle of its own, so a replacement is one swap here. The link then
hands the new writer what the dead one held (buffers, plans, snapshots sent), through
the callbacks those units registered.

A writer killed once (the OOM killer, a stray signal) must not end checkpointing
for a week-long run, but a writer that dies over and over (a storage path it can
never write, a crash on every start) must not be restarted forever either: at most
``max_restarts`` within ``window_s``; the next death is raised as WriterDiedError.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from .client import WriterClient

# Writer deaths tolerated within the window before the next one is raised.
WRITER_RESTART_WINDOW_S = 3600.0


class WriterRestartBudget:
    """Restarts within a sliding window of time."""

    def __init__(
        self, max_restarts: int, window_s: float = WRITER_RESTART_WINDOW_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_restarts = max_restarts
        self.window_s = window_s
        self.clock = clock
        self._times: deque[float] = deque()
        self.count = 0  # restarts over the whole run

    def allow(self) -> bool:
        """Take one restart if the budget has one left."""
        now = self.clock()
        while self._times and now - self._times[0] > self.window_s:
            self._times.popleft()
        if len(self._times) >= self.max_restarts:
            return False
        self._times.append(now)
        self.count += 1
        return True


class WriterLink:
    """The current writer process, and its replacement when it dies.

    In a distributed run the replacement opens the writers' next generation
    (``writer/group.py``): the other ranks dropped the checkpoint in flight, so this
    rank drops what it had sent too (``distributed``) instead of persisting it again.
    """

    def __init__(
        self, writer: WriterClient, factory: Callable[[], WriterClient] | None, max_restarts: int, distributed: bool = False
    ) -> None:
        self.writer = writer
        self.distributed = distributed
        # None: no replacement.
        self._factory = factory
        self.restarts = WriterRestartBudget(max_restarts)
        self._handovers: list[Callable[[WriterClient], None]] = []
        # What the last dead writer sent and nobody read: the handovers read it (dispatch.py).
        self.last_words: list[object] = []

    def on_replaced(self, handover: Callable[[WriterClient], None]) -> None:
        """Call ``handover(new_writer)`` after each replacement, in registration order."""
        self._handovers.append(handover)

    def replace(self) -> bool:
        """Start a new writer in place of the dead one and hand it everything; False if none may start."""
        if self._factory is None or not self.restarts.allow():
            return False
        self.last_words = self.writer.last_words()
        self.writer.close(timeout_s=5.0)  # reap the dead one
        self.writer = self._factory()
        for handover in self._handovers:
            handover(self.writer)
        return True

    def close(self, timeout_s: float) -> None:
        self.writer.close(timeout_s=timeout_s)
