"""The writer's side of a pipelined snapshot: wait for an entry's bytes to land before reading them.

A pipelined request (``PersistRequest.landing_buffer_id``, ``landing_page.py``) reaches the
writer while the trainer's copies into the slot still run. Every read of the slot's bytes
goes through ``wait_for``: the snapshot's checksums (``snapshot_sums.py``), DCP's reads of
each tensor item (``format/shards.py``, the planner's ``resolve_data``) and the exports. The
manifest, written at the commit, waits for every byte (``wait_all``) and takes the copy's
figures from the page. A checkpoint is never committed before its last byte landed.

There is no event to wait on across the two processes: the wait polls the page's word,
backing off from 50 µs to 1 ms (a 16 MiB batch lands in 3 to 10 ms on a CPU, under 1 ms
over PCIe). A trainer that dies takes this writer with it (its lifeline,
``process.py``), so a wait never outlives it; one whose copies stop without it dying
is refused after ``STALL_TIMEOUT_S`` without progress.
"""

from __future__ import annotations

import time

import torch

from .. import protocol as p
from ..errors import CheckpointWriteError, InternalError
from ..landing_page import (
    ABANDONED,
    ALL_LANDED,
    COPIED_BYTES,
    COPY_NS,
    LANDED,
    LANDED_AFTER_REQUEST_NS,
    REQUEST,
    LandingWords,
    apply_landed_figures,
)

FIRST_POLL_S = 50e-6
LAST_POLL_S = 1e-3
# No byte landed for this long while the trainer lives: its copies stopped; the checkpoint is refused.
STALL_TIMEOUT_S = 300.0


class SlotLanding:
    """How much of one pipelined snapshot's slot holds it, read from its landing page."""

    def __init__(self, page: torch.Tensor, slot: torch.Tensor, req: p.PersistRequest) -> None:
        self._page = page  # the mapping, kept alive while the words are read
        self._words = LandingWords(page.data_ptr())
        self._req = req
        self._slot_base, self._slot_nbytes = slot.data_ptr(), slot.numel()
        self._landed = 0  # the last count read: entries below it are never waited for again
        self._figures_applied = False
        about = self._words.read(REQUEST)
        if about != req.request_id:
            raise InternalError(
                f"checkpoint {req.name} (request {req.request_id}) came pipelined, but its landing page is about request {about}"
            )

    @classmethod
    def of(cls, buffers: dict[int, torch.Tensor], req: p.PersistRequest) -> SlotLanding | None:
        """The landing of ``req``'s slot, or None where every byte was in it when it was sent."""
        if req.landing_buffer_id is None:
            return None
        if req.replay is not None:
            raise InternalError(f"checkpoint {req.name} came pipelined and with a replay log: replay steps a slot that has landed")
        page = buffers.get(req.landing_buffer_id)
        if page is None:
            raise InternalError(f"checkpoint {req.name}'s landing page (buffer {req.landing_buffer_id}) was never mapped here")
        return cls(page, buffers[req.buffer_id], req)

    def wait_for(self, end_offset: int) -> None:
        """Return once the slot's first ``end_offset`` bytes hold the snapshot."""
        if end_offset <= self._landed:
            return
        poll_s = FIRST_POLL_S
        last_progress = time.monotonic()
        while True:
            landed = self._words.read(LANDED)
            if landed == ABANDONED:
                raise CheckpointWriteError(
                    f"checkpoint {self._req.name} was abandoned by the training process while its copies landed "
                    "(a copy failed, or the Checkpointer closed); nothing of it is committed"
                )
            if landed > self._landed:
                self._landed = landed
                last_progress = time.monotonic()
            if landed >= end_offset:
                return
            if time.monotonic() - last_progress > STALL_TIMEOUT_S:
                raise CheckpointWriteError(
                    f"checkpoint {self._req.name}: no byte of its slot landed for {STALL_TIMEOUT_S:.0f} s "
                    f"({landed} of {end_offset} needed); its copies stopped, and it is not committed"
                )
            # Polling shared memory: no event crosses the two processes (module docstring).
            time.sleep(poll_s)
            poll_s = min(poll_s * 2, LAST_POLL_S)

    def wait_for_tensor(self, tensor: torch.Tensor) -> None:
        """Return once every byte of ``tensor`` holds the snapshot, where it is a view into the slot (else at once)."""
        start = tensor.data_ptr() - self._slot_base
        if not 0 <= start < self._slot_nbytes:
            return  # not the slot's (the small state's tensors travel in the request)
        extent = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride())) if tensor.numel() else 0
        self.wait_for(start + extent * tensor.element_size())

    def wait_all(self) -> None:
        """Return once every copy landed; the request's stats and ledger then hold the copy's figures."""
        self.wait_for(ALL_LANDED)
        if self._figures_applied:
            return
        words = self._words
        apply_landed_figures(
            self._req.stats,
            self._req.ledger,
            words.read(COPY_NS) / 1e9,
            words.read(COPIED_BYTES),
            words.read(LANDED_AFTER_REQUEST_NS) / 1e9,
        )
        self._figures_applied = True
