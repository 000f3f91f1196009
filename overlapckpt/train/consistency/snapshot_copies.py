"""How one snapshot's copies are issued and fenced: groups, drains, gradients, its version and boundary.

The engine decides *when* (which hook, which step); this unit does *what* for one
snapshot at that moment. Every call takes the current optimizer step and the
serial number of the hook it runs in: a copy enqueued by hook h is fenced by the
first later hook (fence 2, ``transfer.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...format.entries import ROLE_BUFFER
from ..copying.device import TensorRun
from ..copying.slots import GroupTensors
from ..copying.transfer import Copier, CopyTicket, FenceResult
from .boundary import capture_boundary
from .gradlog import GradientLogger
from .snapshot import Snapshot, SnapshotMode, SnapshotState
from .stage_area import StagingArea

# A pipelined snapshot's copy goes in batches of about this many bytes (the writer may write a
# batch's entries once it landed); at most MAX_LANDING_BATCHES of them, each one event.
LANDING_BATCH_BYTES = 16 << 20
MAX_LANDING_BATCHES = 64


@dataclass(frozen=True)
class _Batches:
    """A copy group's batches in slot order, kept per slot and plan (``HostSlot.batches``)."""

    group: GroupTensors  # the gathered group they were cut from: a new one means new batches
    batches: list[tuple[GroupTensors, int]]  # each batch, and the slot bytes landed once it has


class SnapshotCopies:
    """Issues and fences the copies of snapshots; holds no snapshot itself."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        stateful: dict[str, Any],
        copier: Copier,
        staging: StagingArea,
        gradients: GradientLogger,
    ) -> None:
        self.optimizer = optimizer
        self.stateful = stateful
        self.copier = copier
        self.staging = staging
        self.gradients = gradients

    def advance(self, snap: Snapshot, step: int, hook: int) -> None:
        """Post-hook of ``step``: copy (replay) or drain (stage) the group due now."""
        self.enqueue_group(snap, snap.next_group, step, hook)
        if snap.version is None and snap.all_enqueued:
            self.reach_version(snap, step)

    def enqueue_remaining(self, snap: Snapshot, step: int, hook: int) -> None:
        while not snap.all_enqueued:
            self.enqueue_group(snap, snap.next_group, step, hook)

    def close_window(self, snap: Snapshot, step: int, hook: int) -> None:
        """Close a window early at ``step``: copy what is missing now."""
        if snap.version is None and not snap.all_enqueued:
            snap.ledger.closed_early_at = step
        self.enqueue_remaining(snap, step, hook)
        if snap.version is None:
            self.reach_version(snap, step)

    def reach_version(self, snap: Snapshot, version: int) -> None:
        snap.ledger.target_version = version  # the one record of it: snap.version reads it from here on
        # Provisional: ckpt.step() at the end of this iteration captures the boundary again.
        self.capture_boundary(snap)
        snap.state = SnapshotState.AT_BOUNDARY

    def capture_boundary(self, snap: Snapshot) -> None:
        # A scheduler sets the next step's lr between the optimizer step and the end of
        # the iteration: param_groups belong to the boundary, like stateful objects.
        snap.boundary, tickets = capture_boundary(snap.layout, self.optimizer, self.stateful, self.copier)
        snap.tickets.extend(tickets)

    def enqueue_group(self, snap: Snapshot, j: int, step: int, hook: int) -> None:
        views = snap.slot.entry_views(snap.plan, snap.layout)  # first: a new plan drops the slot's cached groups
        from_staging = snap.mode == SnapshotMode.STAGE and j > 0
        key = ("group", j, from_staging)
        group = snap.slot.group_tensors.get(key)
        if group is None or (from_staging and group.staged_from is not snap.staged_views):
            group = self._gather(snap, j, from_staging, views)
            snap.slot.group_tensors[key] = group
            snap.slot.routes.pop(key, None)  # a route kept for another region's views would hold that region
        if snap.landing_batches is not None:
            # Window 1, in batches in slot order: each landed batch extends the bytes the writer may
            # write while the rest still copy (a pipelined persist, landing_page.py).
            for b, (batch, landed_end) in enumerate(self._batches(snap, key, group)):
                ticket = self._enqueue(snap, ("batch", j, b), batch, hook, from_staging=False)
                ticket.group_index = j
                snap.landing_batches.append((ticket, landed_end))
        else:
            self._enqueue(snap, key, group, hook, from_staging).group_index = j
        version = snap.started_step if snap.mode == SnapshotMode.STAGE else step
        snap.ledger.group_enqueued(j, version)
        if snap.replay_log is not None:
            snap.replay_log.group_versions[j] = version
        snap.next_group = j + 1

    def _enqueue(self, snap: Snapshot, key: tuple[object, ...], group: GroupTensors, hook: int, from_staging: bool) -> CopyTicket:
        """One copy of ``group``'s tensors (its route kept under ``key``), fenced as its kind of copy is."""
        src: list[torch.Tensor] = group.sources  # the run itself: the route knows it without comparing its tensors
        dst = group.destinations
        keepalive: list[torch.Tensor] = []
        if group.buffer_positions:
            # Fence 3: the next forward mutates buffers (BatchNorm running stats)
            # before any fence of ours runs: copy clones made now, in order.
            src = list(src)
            clones = self.copier.stage([src[k] for k in group.buffer_positions])
            for k, c in zip(group.buffer_positions, clones):
                src[k] = c
            keepalive = clones
        # The live tensors (or the region's staged views) are the same on every copy under this plan
        # (clones of buffers are not): the route keeps them, and is dropped with a new region (enqueue_group).
        route = snap.slot.route(self.copier, key, src, dst, keep_sources=not keepalive)
        ticket = self.copier.copy_async(src, dst, keepalive=keepalive, route=route)
        snap.tickets.append(ticket)
        if from_staging:
            self.staging.note_drain(ticket)  # no training kernel writes the region: fenced only before its reuse
        else:
            snap.unfenced.append(ticket)
            ticket.fence_after_hook = hook
        return ticket

    @staticmethod
    def _batches(snap: Snapshot, key: tuple[object, ...], group: GroupTensors) -> list[tuple[GroupTensors, int]]:
        """``group`` cut into batches in slot order, each with the slot bytes landed once it and those before it have.

        Made once per slot and plan, like the group itself. A tensor is never cut: one larger
        than a batch is a batch of its own. Batches are ``LANDING_BATCH_BYTES`` long, and at
        most ``MAX_LANDING_BATCHES`` of them (each is one event on the side stream).
        """
        cached = snap.slot.batches.get(key)
        if isinstance(cached, _Batches) and cached.group is group:
            return cached.batches
        for route_key in [k for k in snap.slot.routes if k[:2] == ("batch", key[1])]:
            del snap.slot.routes[route_key]  # routes of the batches of a group gathered before
        offsets, entries = snap.plan.offsets, snap.layout.entries
        order = sorted(range(len(group.indices)), key=lambda k: offsets[group.indices[k]])
        total = sum(entries[i].nbytes for i in group.indices)
        batch_bytes = max(LANDING_BATCH_BYTES, -(-total // MAX_LANDING_BATCHES))
        buffers = set(group.buffer_positions)
        batches: list[tuple[GroupTensors, int]] = []
        run: list[int] = []
        run_bytes = 0
        for n, k in enumerate(order):
            run.append(k)
            run_bytes += entries[group.indices[k]].nbytes
            if run_bytes >= batch_bytes or n == len(order) - 1:
                last = group.indices[run[-1]]
                batch = GroupTensors(
                    tuple(group.indices[k] for k in run),
                    TensorRun(group.sources[k] for k in run),
                    [group.destinations[k] for k in run],
                    tuple(p for p, k in enumerate(run) if k in buffers),
                )
                batches.append((batch, offsets[last] + entries[last].nbytes))
                run, run_bytes = [], 0
        snap.slot.batches[key] = _Batches(group, batches)
        return batches

    @staticmethod
    def _gather(snap: Snapshot, j: int, from_staging: bool, views: list[torch.Tensor]) -> GroupTensors:
        """Group ``j``'s tensors, gathered once per slot and plan (the per-tensor work of its copy)."""
        plan, layout = snap.plan, snap.layout
        idx = plan.groups[j].entry_indices
        if from_staging:
            # Host-resident entries were copied at stage time; the rest drain from the region.
            idx = tuple(i for i in idx if snap.staged_views[i] is not None)
            src = [snap.staged_views[i] for i in idx]
            return GroupTensors(idx, TensorRun(src), [views[i] for i in idx], (), staged_from=snap.staged_views)
        buffers = tuple(k for k, i in enumerate(idx) if layout.entries[i].role == ROLE_BUFFER)
        return GroupTensors(idx, TensorRun(layout.live_tensors[i] for i in idx), [views[i] for i in idx], buffers)

    def log_gradients(self, snap: Snapshot, step: int, hook: int) -> None:
        """The update point of ``step`` inside a replay window: copy the gradients it will consume."""
        if snap.replay_log is None:  # only replay snapshots log gradients; the engine calls this for those
            return
        logged = self.gradients.log(snap.replay_log, snap.slot, snap.plan, snap.layout, snap.next_group, step)
        if logged is None:
            return
        snap.tickets.extend(logged.tickets)
        if logged.fence_before_step is not None:
            # Fence 2 before this step: it writes the gradients in place while the copy reads them.
            count_fence(snap, self.copier.fence_compute(logged.fence_before_step))
        if logged.fence_after_step is not None:
            # Fence 2 after the step (in its post-hook): the next zero_grad or backward may write them in place.
            snap.unfenced.append(logged.fence_after_step)
            logged.fence_after_step.fence_after_hook = hook
        snap.ledger.gradients_logged(step, list(range(snap.next_group)))

    def fence_earlier_copies(self, snap: Snapshot, hook: int) -> None:
        """Fence 2 for copies enqueued by earlier hooks: what they read is about to be mutated."""
        keep: list[CopyTicket] = []
        for ticket in snap.unfenced:
            if ticket.fence_after_hook >= hook:
                keep.append(ticket)
            else:
                count_fence(snap, self.copier.fence_compute(ticket))
        snap.unfenced = keep


def count_fence(snap: Snapshot, result: FenceResult) -> None:
    if result != FenceResult.NOT_NEEDED:
        snap.device_waits_inserted += 1
    if result == FenceResult.WAITED_IN_FLIGHT:
        snap.device_waits_in_flight += 1
