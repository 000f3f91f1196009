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

Posting and reading go to the job's store through a client of this thread's own, and
every value is sealed with the run's key (``sealed_store.py``). A value another client
of the store wrote (``"not-a-number"``, ``"9"``, a signal outside ``save_on_signal``, a
step) is refused, logged and counted in ``FORGED``, and the watch goes on: before the
seal, such values made every rank exit with the signal, or fail trying to install
SIGKILL. A store error before any signal is retried on a new connection; only a
signalled rank that cannot reach the store gives up, as step 4 says.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from ..control_page import AGREED, AGREED_SIGNAL, FORGED, HOLD, NO_AGREEMENT, SIGNAL, STEP, ControlPage
from ..protocol import WriterGroupSpec
from .group import run_keys_prefix
from .sealed_store import SealedStore
from .store_polling import PREEMPTION_POLL_S, PREEMPTION_REQUESTS_PER_POLL, poll_interval_s

logger = logging.getLogger("overlapckpt")

# How often the thread looks at its page (a memory access); the store, one round trip, as
# often up to the world size its server can take, then less often (store_polling.py).
POLL_S = PREEMPTION_POLL_S
# The agreed step is this many boundaries past the largest step posted (see step 3).
AGREEMENT_MARGIN_STEPS = 2
# After a store error while no signal has come: wait this long, then connect again.
RECONNECT_S = 1.0


class PreemptionWatch:
    """The thread that posts this rank's signal, notices any rank's, and agrees on the step."""

    def __init__(self, page: ControlPage, spec: WriterGroupSpec, timeout_s: float, signals: tuple[int, ...]) -> None:
        self.page = page
        self.spec = spec
        self.rank = spec.rank
        self.world_size = spec.world_size
        self.timeout_s = timeout_s
        self.signals = frozenset(int(s) for s in signals)
        self._refused: set[tuple[str, bytes]] = set()
        self.store = self._connect()
        self.thread = threading.Thread(target=self._run, name="overlapckpt-preempt-watch", daemon=True)
        self.thread.start()

    def under_way(self) -> bool:
        """Whether some rank's preemption signal is known here (``HOLD`` set): its checkpoint is the last, and urgent."""
        return self.page.read(HOLD) != 0

    def _connect(self) -> SealedStore:
        base = dist.TCPStore(self.spec.store_host, self.spec.store_port, is_master=False, timeout=timedelta(seconds=self.spec.timeout_s))
        prefix = run_keys_prefix(self.spec) + "preempt/"
        return SealedStore(dist.PrefixStore(prefix, base), self.spec.store_key, prefix)

    def _run(self) -> None:
        posted = False
        store_poll_s = poll_interval_s(self.world_size, PREEMPTION_POLL_S, PREEMPTION_REQUESTS_PER_POLL)
        next_store_poll = 0.0
        try:
            while True:
                local = self.page.read(SIGNAL)
                try:
                    if local and not posted:
                        self.store.set("signal", str(local))  # several ranks may post: any one is the preemption
                        posted = True
                    signum = local
                    if not signum and time.monotonic() >= next_store_poll:
                        next_store_poll = time.monotonic() + store_poll_s
                        signum = self._posted_signal()
                except Exception as e:  # noqa: BLE001 - a store error: not a preemption
                    if local:
                        raise  # signalled and the store cannot be reached: give up below, as step 4 says
                    logger.warning("overlapckpt: the preemption watch of rank %d lost the store (%s: %s); reconnecting", self.rank, type(e).__name__, e)
                    time.sleep(RECONNECT_S)  # nothing to wait on: the store is unreachable
                    self.store = self._connect()
                    continue
                if signum:
                    self._agree(signum)
                    return
                time.sleep(POLL_S)
        except Exception as e:  # noqa: BLE001 - a thread's failure must reach the trainer, not vanish
            logger.error("overlapckpt: the preemption watch of rank %d failed: %s: %s", self.rank, type(e).__name__, e)
            self.page.write(HOLD, 1)
            self.page.write(AGREED, NO_AGREEMENT)

    def _posted_signal(self) -> int:
        """The signal some rank posted, or 0: none, or a value this run's writers did not write."""
        raw = self.store.read_raw("signal")  # never waits: a key another client deletes meanwhile is no signal
        if raw is None:
            return 0
        value = self.store.open("signal", raw)
        signum = int(value) if value is not None and value.isdigit() else 0
        if signum in self.signals:
            return signum
        self._refuse("signal", raw, f"{'a value not sealed by this run' if value is None else repr(value)}, not one of save_on_signal {sorted(self.signals)}")
        return 0

    def _refuse(self, key: str, raw: bytes, why: str) -> None:
        """Count and log a forged value once (the watch sees it again at every poll)."""
        if (key, raw) in self._refused:
            return
        self._refused.add((key, raw))
        self.page.write(FORGED, self.page.read(FORGED) + 1)
        logger.warning(
            "overlapckpt: rank %d's preemption watch ignored %s in the job's store: %s; another client of the store wrote it",
            self.rank, key, why,
        )

    def _agree(self, signum: int) -> None:
        self.page.write(AGREED_SIGNAL, signum)
        self.page.write(HOLD, 1)  # before reading STEP: the trainer stops within one boundary of what is read
        step = self.page.read(STEP)
        self.store.set(f"step/{self.rank}", str(step))
        steps = self._every_rank_step()
        if steps is None:
            return
        agreed = max(steps) + AGREEMENT_MARGIN_STEPS
        logger.info("overlapckpt: preemption: rank %d at step %d, steps %s, agreed on %d", self.rank, step, steps, agreed)
        self.page.write(AGREED, agreed)

    def _every_rank_step(self) -> list[int] | None:
        """Every rank's posted step, sealed; None (and ``NO_AGREEMENT``) if some rank's is missing at the timeout."""
        keys = [f"step/{r}" for r in range(self.world_size)]
        deadline = time.monotonic() + self.timeout_s
        steps: dict[str, int] = {}
        waited = False
        while True:
            for key in keys:
                raw = None if key in steps else self.store.read_raw(key)
                if raw is None:
                    continue
                value = self.store.open(key, raw)
                if value is not None and value.isdigit():
                    steps[key] = int(value)
                else:
                    self._refuse(key, raw, "a step not sealed by this run's writers")
            pending = [k for k in keys if k not in steps]
            remaining = deadline - time.monotonic()
            if not pending or remaining <= 0:
                break
            if waited:
                time.sleep(POLL_S)  # every pending key existed, yet some hold forged values: look again soon
            try:
                # Server-side: returns once every pending key exists (one request, whatever the world size).
                self.store.wait(pending, timedelta(seconds=min(remaining, 1.0)))
                waited = True
            except Exception:  # noqa: BLE001 - the store's timeout error type varies across torch releases
                waited = False
        if len(steps) == len(keys):
            return [steps[k] for k in keys]
        missing = [k for k in keys if k not in steps]
        logger.error(
            "overlapckpt: rank %d could not agree on a preemption step within %.1f s (no step from %s); "
            "exiting with the signal without a checkpoint",
            self.rank, self.timeout_s, ", ".join(missing) or "?",
        )
        self.page.write(AGREED, NO_AGREEMENT)
        return None
