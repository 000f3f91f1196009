"""Stage mode's staging area: device memory that holds groups 1..W-1 at version s while they drain.

Before step s+1 can mutate anything, the groups not yet copied are cloned
device-to-device (fast, HBM) into one staging region; the engine then drains one
group per step from it to the host slot, on the side stream, with no fence against
training (no training kernel touches the region).

* One region, allocated once, outside the checkpoints' hooks: at construction when the
  optimizer state exists, else right after the first optimizer step (where the host
  slots are sized too), sized for the widest window. An allocation inside a
  checkpoint's hook could raise out-of-memory inside ``optimizer.step()``, or take the
  caching allocator's free-and-retry path (``cudaFree``: a device synchronization).
  It is kept for the Checkpointer's life and released at ``close()``; a state that
  grows past it is the one reallocation left in a hook (as for host slots).
* Checked before it is allocated, against what a new allocation can get:
  ``mem_get_info``'s free bytes. The caching allocator's reserved-but-unused blocks
  do not count: fragmented, they may not hold a region of this size. A region that
  cannot fit raises ``ConfigError`` naming the bytes.
* The budget (``stage_budget_bytes``) caps it, whatever ``max_inflight`` is. A new
  snapshot that needs the region while an earlier one still drains from it has the
  engine enqueue the earlier one's remaining drains at once, and the training stream
  waits for every drain before overwriting the region (fence 4). So there is only ever
  one region, and only ever one snapshot's groups in it.
* State that lives on the host (a CPU ``step`` counter of a non-capturable Adam) is
  not staged: it is copied straight into the host slot at stage time, which is exact
  at version s, instead of a synchronizing host-to-device copy into the region.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...errors import ConfigError, InternalError
from ...hostbuf import view_bytes
from ..copying.device import TensorRun
from ..copying.host_values import HostValues
from ..copying.layout import StateLayout
from ..copying.plan import CopyPlan, align_bytes
from ..copying.transfer import Copier, CopyTicket


def staged_entry_indices(plan: CopyPlan) -> list[int]:
    """The entries stage mode clones at the request: those of groups 1..W-1."""
    return [i for g in plan.groups[1:] for i in g.entry_indices]


def _region_nbytes(entry_nbytes: list[int]) -> int:
    # Each entry starts aligned, as in the host slot, so every dtype views it in place.
    return sum(align_bytes(n) for n in entry_nbytes)


@dataclass(eq=False)
class _PreparedStage:
    """One plan's staging, worked out on its first snapshot: no later snapshot does work per tensor."""

    plan: CopyPlan
    layout: StateLayout
    on_device: list[int]  # entry indices cloned into the region
    on_host: list[int]  # entry indices copied to the host slot at once
    device_sources: TensorRun
    host_sources: TensorRun
    region_nbytes: int
    staged: list[torch.Tensor | None]  # what stage() returns, per entry
    region: torch.Tensor | None = None  # the region the views below view
    region_views: TensorRun = field(default_factory=TensorRun)
    # Per host slot (its views list, by id): the host copies into it.
    host_values: dict[int, tuple[list[torch.Tensor], HostValues | None]] = field(default_factory=dict)


class StagingArea:
    """The one staging region, its budget, and the drains that still read it."""

    def __init__(self, copier: Copier, budget_bytes: int | None) -> None:
        self.copier = copier
        self.budget_bytes = budget_bytes
        self.region: torch.Tensor | None = None
        self._drains: list[CopyTicket] = []  # drain copies that read the region and may not have landed
        self._plan: _PreparedStage | None = None  # what staging the last plan takes: reused while it holds

    def needed_bytes(self, plan: CopyPlan, layout: StateLayout) -> int:
        """Bytes the region needs for ``plan``: the entries of groups 1..W-1 that live on the device."""
        return _region_nbytes(
            [layout.entries[i].nbytes for i in staged_entry_indices(plan) if self.copier.is_device_resident(layout.live_tensors[i])]
        )

    def fits(self, needed_bytes: int) -> bool:
        return self.budget_bytes is None or needed_bytes <= self.budget_bytes

    def reserve(self, needed_bytes: int, window: int, state_nbytes: int) -> None:
        """Hold a region of at least ``needed_bytes`` (ConfigError if over budget or it cannot be allocated)."""
        if not self.fits(needed_bytes):
            raise ConfigError(
                f"stage mode needs {needed_bytes} bytes of staging for window {window} (groups 1..{window - 1} "
                f"of {state_nbytes} bytes of state), but stage_budget_bytes={self.budget_bytes}; raise "
                f"stage_budget_bytes to at least {needed_bytes}, use a smaller window, or use consistency='replay'"
            )
        if needed_bytes == 0 or (self.region is not None and self.region.numel() >= needed_bytes):
            return
        available = self.copier.device_free_bytes()
        if available is not None and needed_bytes > available:
            raise ConfigError(
                f"stage mode needs {needed_bytes} bytes of device memory for staging (window {window}), but a new "
                f"allocation can get only {available} bytes (free device memory, mem_get_info); use a smaller "
                "window, consistency='replay' (no device memory), or free device memory"
            )
        self.region = None  # freed first, so the old and the new region are never both held
        if self._plan is not None:
            self._plan.region = None  # its views view the old region
            self._plan.region_views = TensorRun()
        self.region = self.copier.allocate_on_training_stream(needed_bytes)

    def stage(self, plan: CopyPlan, layout: StateLayout, host_views: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """Clone groups 1..W-1 now, on the training stream, in order after step s: version s.

        Returns, per entry, the staged tensor its drain copies from; None where the
        entry was copied to ``host_views`` at once (host-resident state) or is in group 0.
        The list is the same object for every snapshot of this plan and region (callers
        do not change it), so what is derived from it can be kept too.
        The caller enqueued every drain still reading the region first.
        """
        prepared = self._prepared(plan, layout)
        host = prepared.host_values.get(id(host_views))
        if host is None or host[0] is not host_views:
            on_host = prepared.on_host
            host = (host_views, HostValues([layout.live_tensors[i] for i in on_host], [host_views[i] for i in on_host]) if on_host else None)
            prepared.host_values[id(host_views)] = host
        if host[1] is not None:
            host[1].copy_now(prepared.host_sources)
        if not prepared.on_device:
            return prepared.staged
        for ticket in self._drains:
            # Fence 4: the earlier snapshot's drains read this region on the side stream;
            # the training stream must not overwrite it, nor reuse its memory once freed
            # below, before they are done.
            self.copier.fence_compute(ticket)
        self._drains = []
        # Held since construction or the first step; only a state that grew reallocates here.
        self.reserve(prepared.region_nbytes, plan.window_steps, layout.nbytes)
        region = self.region
        if region is None:
            raise InternalError("stage mode found no staging region after reserving it")
        if prepared.region is not region:
            # Views and sources are the same tensors for every snapshot of this plan and region:
            # made once (TensorRuns, so the device keeps its per-tensor work for them too).
            cursor = 0
            region_views = TensorRun()
            for i in prepared.on_device:
                e = layout.entries[i]
                region_views.append(view_bytes(region, cursor, e.dtype, e.shape))
                cursor += align_bytes(e.nbytes)
            staged: list[torch.Tensor | None] = [None] * len(layout.entries)
            for i, view in zip(prepared.on_device, region_views):
                staged[i] = view
            prepared.region, prepared.region_views, prepared.staged = region, region_views, staged
        self.copier.copy_on_training_stream(prepared.region_views, prepared.device_sources)
        return prepared.staged

    def _prepared(self, plan: CopyPlan, layout: StateLayout) -> _PreparedStage:
        """What staging ``plan`` takes, worked out once per plan (which entries live where, their sources)."""
        prepared = self._plan
        if prepared is None or prepared.plan is not plan or prepared.layout is not layout:
            later = staged_entry_indices(plan)
            resident = [self.copier.is_device_resident(layout.live_tensors[i]) for i in later]
            on_device = [i for i, r in zip(later, resident) if r]
            on_host = [i for i, r in zip(later, resident) if not r]
            prepared = self._plan = _PreparedStage(
                plan=plan,
                layout=layout,
                on_device=on_device,
                on_host=on_host,
                device_sources=TensorRun(layout.live_tensors[i] for i in on_device),
                host_sources=TensorRun(layout.live_tensors[i] for i in on_host),
                region_nbytes=_region_nbytes([layout.entries[i].nbytes for i in on_device]),
                staged=[None] * len(layout.entries),
            )
        return prepared

    def note_drain(self, ticket: CopyTicket) -> None:
        self._drains.append(ticket)

    def forget_landed_drains(self) -> None:
        """Stop tracking the drains that have landed (the region stays for the next snapshot)."""
        self._drains = [t for t in self._drains if not self.copier.poll(t)]

    def release(self) -> None:
        self._drains = []
        self._plan = None
        self.region = None
