"""Preemption agreed across ranks, by the writers: one step at which every rank checkpoints, then exits.

Runs in a thread of each writer process of a distributed run with ``save_on_signal``.
The training processes never take part in it: each reads the outcome from its control
page (``control_page.py``) at its iteration boundaries, so no hook runs a collective.

1. **Any rank signalled.** A training process that receives the signal writes it to
   its page; this rank's writer posts it under the run's ``preempt/signal`` key. A
   rank that is never signalled learns of it here, from the store: the one signalled
   rank tells the others.
2. **Hold.** Every writer that sees the key sets ``HOLD`` in its page (its trainer will
   not pass its next boundary until the agreement is known), then reads the last
   boundary its trainer passed (``STEP``) and posts it under ``preempt/step/<rank>``.
3. **Agree.** Once every rank's step is posted, each writer computes the same step:
   ``max(steps) + AGREEMENT_MARGIN_STEPS``, and writes it to ``AGREED``. No trainer
   can have passed it: each stops at most one boundary after the step its writer read
   (``HOLD`` was set before the read; the margin covers the one boundary a trainer
   may pass while its writer sets ``HOLD``), and the step is at least every rank's.
   Nor can any rank be kept from reaching it: a rank held at a boundary has finished
   that step's collectives, so the others can reach the same step.
4. **Bounded.** If some rank's step is not posted within ``timeout_s`` (a rank that
   died, a writer that cannot reach the store), ``AGREED`` becomes ``NO_AGREEMENT``:
   every trainer then exits with the signal at once, saying why.

Posting and reading go to the job's store through a client of this thread's own.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from ..control_page import AGREED, AGREED_SIGNAL, HOLD, NO_AGREEMENT, SIGNAL, STEP, ControlPage
from ..protocol import WriterGroupSpec
from .group import run_keys_prefix

logger = logging.getLogger("overlapckpt")

# How often the thread looks at its page and at the store: a store check is one round
# trip, a page read a memory access; 10 ms is far below any grace period.
POLL_S = 0.01
# The agreed step is this many boundaries past the largest step posted (see step 3).
AGREEMENT_MARGIN_STEPS = 2


class PreemptionWatch:
    """The thread that posts this rank's signal, notices any rank's, and agrees on the step."""

    def __init__(self, page: ControlPage, spec: WriterGroupSpec, timeout_s: float) -> None:
        self.page = page
        self.rank = spec.rank
        self.world_size = spec.world_size
        self.timeout_s = timeout_s
        base = dist.TCPStore(spec.store_host, spec.store_port, is_master=False, timeout=timedelta(seconds=spec.timeout_s))
        self.store = dist.PrefixStore(run_keys_prefix(spec) + "preempt/", base)
        self.thread = threading.Thread(target=self._run, name="overlapckpt-preempt-watch", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        posted = False
        try:
            while True:
                signum = self.page.read(SIGNAL)
                if signum and not posted:
                    self.store.set("signal", str(signum))  # several ranks may post: any one is the preemption
                    posted = True
                if self.store.check(["signal"]):
                    self._agree()
                    return
                time.sleep(POLL_S)
        except Exception as e:  # noqa: BLE001 - a thread's failure must reach the trainer, not vanish
            logger.error("overlapckpt: the preemption watch of rank %d failed: %s: %s", self.rank, type(e).__name__, e)
            self.page.write(HOLD, 1)
            self.page.write(AGREED, NO_AGREEMENT)

    def _agree(self) -> None:
        signum = int(self.store.get("signal"))
        self.page.write(AGREED_SIGNAL, signum)
        self.page.write(HOLD, 1)  # before reading STEP: the trainer stops within one boundary of what is read
        step = self.page.read(STEP)
        self.store.set(f"step/{self.rank}", str(step))
        keys = [f"step/{r}" for r in range(self.world_size)]
        try:
            self.store.wait(keys, timedelta(seconds=self.timeout_s))
        except Exception as e:  # noqa: BLE001 - the store's timeout error type varies across torch releases
            missing = [k for k in keys if not self.store.check([k])]
            logger.error(
                "overlapckpt: rank %d could not agree on a preemption step within %.1f s (no step from %s: %s); "
                "exiting with the signal without a checkpoint",
                self.rank, self.timeout_s, ", ".join(missing) or "?", e,
            )
            self.page.write(AGREED, NO_AGREEMENT)
            return
        steps = [int(self.store.get(k)) for k in keys]
        agreed = max(steps) + AGREEMENT_MARGIN_STEPS
        logger.info("overlapckpt: preemption: rank %d at step %d, steps %s, agreed on %d", self.rank, step, steps, agreed)
        self.page.write(AGREED, agreed)
