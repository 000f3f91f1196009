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

Under torch.distributed the ranks must checkpoint the same step, and a signal reaches
each at a different one (torchrun forwards SIGTERM to every worker; a node's kubelet or
SLURM may signal some ranks only). The writers agree on one step for every rank
(``writer/preempt_watch.py``), through the control page this process shares with its
writer (``control_page.py``): at each boundary the guard writes the step it reached
and reads, in two memory accesses, whether a preemption is under way. When it is,
the guard holds at the next boundary until the agreed step is known, trains on to it,
checkpoints there like every other rank, and exits with the signal. No hook ever
runs a collective. Without an agreement within the grace period (a rank died, a
writer is gone), each rank exits with the signal and says why.

torchrun's agent sends SIGTERM to every worker and, ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``
seconds later (30 by default), SIGKILL: the default grace (``default_grace_s``) ends
five seconds before that.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

from ...control_page import AGREED, AGREED_SIGNAL, HOLD, NO_AGREEMENT, NOT_YET, SIGNAL, STEP, ControlPage
from ...errors import ConfigError

logger = logging.getLogger("overlapckpt")

# torchrun's agent escalates to SIGKILL this long after forwarding SIGTERM, unless
# TORCH_ELASTIC_SHUTDOWN_TIMEOUT says otherwise; the default grace ends this margin before.
TORCHRUN_SHUTDOWN_TIMEOUT_S = 30.0
KILL_MARGIN_S = 5.0
# How often a held trainer looks at its page for the agreed step.
HOLD_POLL_S = 0.001


def default_grace_s() -> float:
    """Seconds from the signal to the commit by default: inside torchrun's SIGTERM-to-SIGKILL window."""
    try:
        window = float(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", TORCHRUN_SHUTDOWN_TIMEOUT_S))
    except ValueError:
        window = TORCHRUN_SHUTDOWN_TIMEOUT_S
    return max(1.0, window - KILL_MARGIN_S)


class PreemptionGuard:
    """The installed handlers, the signal waiting for a boundary, and the save."""

    def __init__(
        self,
        signals: tuple[int, ...],
        grace_s: float,
        save: Callable[[float], Any],
        page: ControlPage | None = None,
        current_step: Callable[[], int] | None = None,
    ) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise ConfigError(
                f"save_on_signal={signals!r} needs the Checkpointer built in the main thread (Python installs "
                "signal handlers there only); build it there, or leave save_on_signal empty"
            )
        self.grace_s = grace_s
        self._save = save
        self._page = page  # distributed: shared with this rank's writer, which agrees with the others
        self._current_step = current_step
        self._deadline: float | None = None
        self.pending: int | None = None
        self.signals = tuple(signals)
        self._handling = False
        self._previous: dict[int, Any] = {}
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._handler)

    def _handler(self, signum: int, frame: Any) -> None:
        # Only record it: this may run inside a hook or inside the optimizer's update.
        if self.pending is None and not self._handling:
            self.pending = signum
            if self._page is not None:
                self._page.write(SIGNAL, signum)  # this rank's writer tells the others

    def at_boundary(self) -> None:
        """Called at each iteration boundary: if a signal came, save, then exit as it would have."""
        if self._page is not None:
            self._at_boundary_agreed(self._page)
            return
        if self.pending is None or self._handling:
            return
        self._handling = True
        self._save_and_exit(self.pending, self.grace_s)

    def _at_boundary_agreed(self, page: ControlPage) -> None:
        """Distributed: checkpoint at the step every rank agreed on (writer/preempt_watch.py), then exit."""
        assert self._current_step is not None
        step = self._current_step()
        page.write(STEP, step)  # where this rank is, for its writer to post
        if self._handling or (self.pending is None and not page.read(HOLD)):
            return  # no preemption: two memory accesses
        if self._deadline is None:
            self._deadline = time.monotonic() + self.grace_s
        agreed = page.read(AGREED)
        if agreed == NOT_YET and page.read(HOLD):
            agreed = self._hold(page)
        signum = page.read(AGREED_SIGNAL)
        if signum not in self.signals:  # the writers post only these; anything else is no signal of ours
            signum = self.pending or self.signals[0]
        if agreed == NOT_YET:
            if time.monotonic() < self._deadline:
                return  # this rank's signal, not yet seen by the writers: train on
            why = f"no step was agreed within the grace period ({self.grace_s:.0f} s)"
        elif agreed == NO_AGREEMENT:
            why = "the ranks could not agree on a step to checkpoint within the grace period (the writers' log says which rank was missing)"
        elif step > agreed:
            why = f"this rank is at step {step}, past the step {agreed} the ranks agreed on"
        elif step < agreed:
            return  # train on to the agreed step
        else:
            self._handling = True
            logger.info("overlapckpt: preemption: checkpointing the agreed step %d, then exiting with %s", step, signal.Signals(signum).name)
            self._save_and_exit(signum, max(0.0, self._deadline - time.monotonic()))
            return
        self._handling = True
        self._exit_without_checkpoint(signum, why)

    def _hold(self, page: ControlPage) -> int:
        """Stay at this boundary until the agreed step is known, or the grace period ends."""
        assert self._deadline is not None
        while time.monotonic() < self._deadline:
            agreed = page.read(AGREED)
            if agreed != NOT_YET:
                return agreed
            time.sleep(HOLD_POLL_S)
        return NOT_YET

    def _exit_without_checkpoint(self, signum: int, why: str) -> None:
        logger.error("overlapckpt: %s: exiting without a checkpoint: %s", signal.Signals(signum).name, why)
        self.uninstall()
        self._exit_as_signal(signum)

    def _save_and_exit(self, signum: int, timeout_s: float) -> None:
        try:
            self._save(timeout_s)
        except Exception as e:  # the process is going down either way: say why the save failed
            logger.error("overlapckpt: the checkpoint on %s failed: %s", signal.Signals(signum).name, e)
        finally:
            self.uninstall()
        self._exit_as_signal(signum)

    def _exit_as_signal(self, signum: int) -> None:
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
