"""Host slots and the record of one in-flight snapshot.

A snapshot moves through these states (implemented in ``engine.py``)::

    OPEN: groups are being enqueued, one per step; ``version`` is set once the
          snapshot's version V is reached (small state and boundary captured then)
    OPEN ──(version set, every group enqueued, boundary closed, every copy's
           event fired)──► SENT (the persist request is queued to the writer)
    SENT ──(writer answered)──► removed: committed or failed; the slot is free again
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .hostbuf import SharedHostBuffer
from .ledger import CheckpointLedger
from .plan import CopyPlan
from .state import StateLayout
from .transfer import CopyTicket

OPEN = "open"
SENT = "sent"


@dataclass
class HostSlot:
    """Host memory for one snapshot, reused for every checkpoint that lands in it."""

    slot_id: int
    buffer: SharedHostBuffer
    busy: bool = False
    # Destination views for each entry, cached per plan: building them costs host time.
    views_key: tuple[int, int] | None = None  # (layout fingerprint, window) of the cached views
    views: list[torch.Tensor] = field(default_factory=list)
    # Replay mode: the gradients the window logs. Stage mode: the device staging area.
    grad_buffer: SharedHostBuffer | None = None
    grad_buffer_id: int | None = None
    grad_offsets: dict[tuple[int, str], int] = field(default_factory=dict)
    grad_views: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    grad_plan_key: tuple[int, int] | None = None  # (layout fingerprint, window) of the gradient views
    staging: torch.Tensor | None = None
    staged_views: list[torch.Tensor] = field(default_factory=list)
    staging_ready_tickets: list[CopyTicket] = field(default_factory=list)

    def entry_views(self, plan: CopyPlan, layout: StateLayout) -> list[torch.Tensor]:
        key = (plan.fingerprint, plan.window_steps)
        if self.views_key != key or len(self.views) != len(layout.entries):
            self.views = [
                self.buffer.view(off, e.dtype, e.shape) for e, off in zip(layout.entries, plan.offsets)
            ]
            self.views_key = key
        return self.views


@dataclass
class Snapshot:
    """One checkpoint between its request and its commit."""

    request_id: int
    requested_step: int
    window: int
    mode: str  # "window" (W=1), "replay" or "stage"
    slot: HostSlot
    plan: CopyPlan
    layout: StateLayout
    layout_id: int
    ledger: CheckpointLedger
    state: str = OPEN
    next_group: int = 0
    version: int | None = None
    tickets: list[CopyTicket] = field(default_factory=list)
    # Copies enqueued by an earlier hook whose fence the compute stream has not yet got.
    unfenced: list[CopyTicket] = field(default_factory=list)
    fenced_at_hook: int = -1
    small_state: dict[str, Any] | None = None
    extra_state: dict[str, Any] | None = None
    boundary_open: bool = False
    replay_log: Any = None
    requested_wall_s: float = field(default_factory=time.time)
    requested_perf_s: float = field(default_factory=time.perf_counter)
    device_waits_inserted: int = 0
    device_waits_in_flight: int = 0
    hook_host_s: float = 0.0
    deferred: bool = False

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes

    def landed(self) -> bool:
        return all(t.landed_at_s is not None for t in self.tickets)
