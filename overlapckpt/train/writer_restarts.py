"""How many times a dead writer process is replaced before checkpointing gives up.

A writer killed once (the OOM killer, a stray signal) must not end checkpointing
for a week-long run, but a writer that dies over and over (a storage path it can
never write, a crash on every start) must not be restarted forever either: at most
``max_restarts`` within ``window_s``; the next death is raised as WriterDiedError.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

# Writer deaths tolerated within the window before the next one is raised.
DEFAULT_MAX_WRITER_RESTARTS = 3
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
