"""Save on preemption: on a configured signal, checkpoint the current step, commit, then die of the signal.

Spot instances, Kubernetes and SLURM send SIGTERM (or another signal) some grace
period before the kill. The handler itself only records the signal: it may run in
the middle of a hook, or in the middle of the optimizer's update, where the state
is not at any version. The save happens at the next iteration boundary
(``ckpt.step()``, or the optimizer's post-step hook when the loop never calls it):

1. every open window closes at the current step (replay's version becomes this
   step; stage keeps its own), and a checkpoint of this step is requested unless
   one already covers it;
2. everything in flight commits, waited for up to ``grace_s``;
3. the previous handler is put back and the signal is delivered again, so the
   process exits with the signal's status (or the previous Python handler runs).

A second signal while the save runs is ignored: the grace period bounds it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any

from ..errors import ConfigError


class PreemptionGuard:
    """The installed handlers, the signal waiting for a boundary, and the save."""

    def __init__(self, signals: tuple[int, ...], grace_s: float, save: Callable[[float], Any]) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise ConfigError(
                f"save_on_signal={signals!r} needs the Checkpointer built in the main thread (Python installs "
                "signal handlers there only); build it there, or leave save_on_signal empty"
            )
        self.grace_s = grace_s
        self._save = save
        self.pending: int | None = None
        self._handling = False
        self._previous: dict[int, Any] = {}
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._handler)

    def _handler(self, signum: int, frame: Any) -> None:
        # Only record it: this may run inside a hook or inside the optimizer's update.
        if self.pending is None and not self._handling:
            self.pending = signum

    def at_boundary(self) -> None:
        """Called at each iteration boundary: if a signal came, save, then exit as it would have."""
        if self.pending is None or self._handling:
            return
        self._handling = True
        signum = self.pending
        try:
            self._save(self.grace_s)
        except Exception as e:  # the process is going down either way: say why the save failed
            print(f"overlapckpt: the checkpoint on {signal.Signals(signum).name} failed: {e}", file=sys.stderr, flush=True)
        finally:
            self.uninstall()
        previous = self._previous.get(signum)
        if callable(previous):
            previous(signum, None)
        elif previous != signal.SIG_IGN:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)  # exit with the signal's status, as without us

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            try:
                if signal.getsignal(sig) == self._handler:
                    signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
            except (ValueError, TypeError) as e:  # not the main thread any more
                warnings.warn(f"overlapckpt: could not restore the handler of signal {sig}: {e}", stacklevel=2)
