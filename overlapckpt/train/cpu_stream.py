"""A CUDA stream modelled on the CPU, so CPU tests exercise every fence the GPU path has.

``CpuStreamCopier`` runs copies in order on one worker thread (tensor copies
release the GIL, so they overlap the training thread) and sets an event when each
batch is done. What is a device-side wait on CUDA becomes a host wait here: the
training thread blocks in ``fence_compute`` until the copy has read its sources,
right before the mutation the fence guards.

``hold_until_waited=True`` is the adversarial schedule the fence tests use: the
worker starts a copy only once someone waits for it (a fence, ``wait``), the latest
moment a real stream could run it. A missing fence then lets the guarded mutation
run first, and the snapshot tears on every run, not by chance.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import CopyStreamStuckError
from .transfer import (
    CopyTicket,
    FenceResult,
    copy_on_host,
    gather_into_scratch,
    plan_packed_copy,
    tensor_nbytes,
)

# A fence or wait that takes longer than this means the worker thread is stuck.
_WORKER_STUCK_S = 600.0


@dataclass
class _CopyTask:
    sources: list[torch.Tensor]
    destinations: list[torch.Tensor]
    ticket: CopyTicket
    release: threading.Event


class CpuStreamCopier:
    """Copies on a worker thread, in order, each batch signalled by an event."""

    pins_host_memory = False

    def __init__(self, hold_until_waited: bool = False, clone_is_cheap: bool = False, small_values_on_device: bool = False) -> None:
        self.hold_until_waited = hold_until_waited
        # Model small values (a tensor lr, GradScaler's scale) as device-resident: their copies
        # are deferred through the stream like a GPU's, so the CPU tests reach fence 5.
        self.small_values_on_device = small_values_on_device
        # Replay's gradient strategy (see GradientLogger): tests run both on the CPU.
        self.clone_is_cheap = clone_is_cheap
        self._queue: queue.SimpleQueue[_CopyTask | None] = queue.SimpleQueue()
        self._pending: list[_CopyTask] = []  # enqueued, in order, not yet known to be done
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def _ensure_worker(self) -> None:
        if self._thread is None:
            # A daemon, joined by close(): a training script that never closes its
            # Checkpointer must still be able to exit.
            self._thread = threading.Thread(target=self._run, name="overlapckpt-copy-stream", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            task = self._queue.get()
            if task is None:
                return
            task.release.wait()
            started = time.perf_counter()
            try:
                packed, rest = plan_packed_copy(task.sources, task.destinations)
                if packed is not None:
                    packed.span.copy_(gather_into_scratch(packed, torch.device("cpu")))
                copy_on_host([task.sources[k] for k in rest], [task.destinations[k] for k in rest])
            except BaseException as e:  # handed to whoever polls or waits on the ticket
                task.ticket.error = e
            finished = time.perf_counter()
            task.ticket.copy_s = finished - started
            task.ticket.keepalive.clear()
            task.ticket.done_event.set()

    def copy_async(
        self,
        sources: Sequence[torch.Tensor],
        destinations: Sequence[torch.Tensor],
        keepalive: Sequence[torch.Tensor] = (),
    ) -> CopyTicket:
        # Fence 1 is the host's program order: the optimizer step that wrote the
        # sources ran on this thread before the call.
        self._ensure_worker()
        ticket = CopyTicket(
            nbytes=sum(tensor_nbytes(d) for d in destinations),
            enqueued_at_s=time.perf_counter(),
            done_event=threading.Event(),
            keepalive=list(keepalive),
        )
        release = threading.Event()
        if not self.hold_until_waited:
            release.set()
        task = _CopyTask(list(sources), list(destinations), ticket, release)
        with self._lock:
            self._pending.append(task)
        self._queue.put(task)
        return ticket

    def is_device_resident(self, t: torch.Tensor) -> bool:
        return self.small_values_on_device or t.device.type != "cpu"

    def stage(self, sources: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Host clones on the training thread: the CPU twin of a clone on the compute stream."""
        with torch.no_grad():
            return [s.detach().clone() for s in sources]

    def fence_compute(self, ticket: CopyTicket) -> FenceResult:
        """Block the training thread until the copy has read its sources (the CPU twin of a device wait)."""
        if ticket.landed_at_s is not None:
            return FenceResult.NOT_NEEDED
        in_flight = not ticket.done_event.is_set()
        self._wait_done(ticket)
        return FenceResult.WAITED_IN_FLIGHT if in_flight else FenceResult.WAITED_LANDED

    def poll(self, ticket: CopyTicket) -> bool:
        if ticket.landed_at_s is not None:
            return True
        if not ticket.done_event.is_set():
            return False
        self._mark_landed(ticket)
        return True

    def wait(self, ticket: CopyTicket) -> None:
        if ticket.landed_at_s is None:
            self._wait_done(ticket)

    def synchronize(self) -> None:
        with self._lock:
            last = self._pending[-1].ticket if self._pending else None
        if last is not None:
            self.wait(last)

    def close(self) -> None:
        self.synchronize()
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=_WORKER_STUCK_S)
            self._thread = None

    def _wait_done(self, ticket: CopyTicket) -> None:
        # The stream runs in order: this copy starts only after every earlier one.
        with self._lock:
            for task in self._pending:
                task.release.set()
                if task.ticket is ticket:
                    break
        if not ticket.done_event.wait(timeout=_WORKER_STUCK_S):
            raise CopyStreamStuckError(
                f"a {ticket.nbytes}-byte host copy did not finish within {_WORKER_STUCK_S} s; the copy "
                "worker thread is stuck"
            )
        self._mark_landed(ticket)

    def _mark_landed(self, ticket: CopyTicket) -> None:
        ticket.landed_at_s = time.perf_counter()
        with self._lock:
            self._pending = [t for t in self._pending if t.ticket is not ticket]
        if ticket.error is not None:
            raise ticket.error
