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

import torch

from ...errors import ConfigError, InternalError
from ...hostbuf import view_bytes
from ..copying.device import TensorRun
from ..copying.layout import StateLayout
from ..copying.plan import CopyPlan, align_bytes
from ..copying.transfer import Copier, CopyTicket, copy_on_host


def staged_entry_indices(plan: CopyPlan) -> list[int]:
    """The entries stage mode clones at the request: those of groups 1..W-1."""
    return [i for g in plan.groups[1:] for i in g.entry_indices]


def _region_nbytes(entry_nbytes: list[int]) -> int:
    # Each entry starts aligned, as in the host slot, so every dtype views it in place.
    return sum(align_bytes(n) for n in entry_nbytes)


class StagingArea:
    """The one staging region, its budget, and the drains that still read it."""

    def __init__(self, copier: Copier, budget_bytes: int | None) -> None:
        self.copier = copier
        self.budget_bytes = budget_bytes
        self.region: torch.Tensor | None = None
        self._drains: list[CopyTicket] = []  # drain copies that read the region and may not have landed
        # (key, layout, entry indices, region views, live sources) of the last plan staged: reused while it holds.
        self._views: tuple[tuple[int, int, int, int], StateLayout, list[int], TensorRun, TensorRun] | None = None

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
        self._views = None  # they view the old region
        self.region = self.copier.allocate_on_training_stream(needed_bytes)

    def stage(self, plan: CopyPlan, layout: StateLayout, host_views: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """Clone groups 1..W-1 now, on the training stream, in order after step s: version s.

        Returns, per entry, the staged tensor its drain copies from; None where the
        entry was copied to ``host_views`` at once (host-resident state) or is in group 0.
        The caller enqueued every drain still reading the region first.
        """
        staged: list[torch.Tensor | None] = [None] * len(layout.entries)
        later = staged_entry_indices(plan)
        if not later:
            return staged
        resident = [self.copier.is_device_resident(layout.live_tensors[i]) for i in later]
        on_device = [i for i, r in zip(later, resident) if r]
        on_host = [i for i, r in zip(later, resident) if not r]
        copy_on_host([layout.live_tensors[i] for i in on_host], [host_views[i] for i in on_host])
        if not on_device:
            return staged
        for ticket in self._drains:
            # Fence 4: the earlier snapshot's drains read this region on the side stream;
            # the training stream must not overwrite it, nor reuse its memory once freed
            # below, before they are done.
            self.copier.fence_compute(ticket)
        self._drains = []
        # Held since construction or the first step; only a state that grew reallocates here.
        self.reserve(_region_nbytes([layout.entries[i].nbytes for i in on_device]), plan.window_steps, layout.nbytes)
        region = self.region
        if region is None:
            raise InternalError("stage mode found no staging region after reserving it")
        key = (region.data_ptr(), id(layout), plan.fingerprint, plan.window_steps)
        if self._views is None or self._views[0] != key or self._views[1] is not layout:
            cursor = 0
            region_views = TensorRun()
            for i in on_device:
                e = layout.entries[i]
                region_views.append(view_bytes(region, cursor, e.dtype, e.shape))
                cursor += align_bytes(e.nbytes)
            # Views and sources are the same tensors for every snapshot of this plan: made once
            # (a TensorRun, so the device keeps its per-tensor work for them too).
            self._views = (key, layout, on_device, region_views, TensorRun(layout.live_tensors[i] for i in on_device))
        _, _, indices, region_views, sources = self._views
        for i, view in zip(indices, region_views):
            staged[i] = view
        self.copier.copy_on_training_stream(region_views, sources)
        return staged

    def note_drain(self, ticket: CopyTicket) -> None:
        self._drains.append(ticket)

    def forget_landed_drains(self) -> None:
        """Stop tracking the drains that have landed (the region stays for the next snapshot)."""
        self._drains = [t for t in self._drains if not self.copier.poll(t)]

    def release(self) -> None:
        self._drains = []
        self._views = None
        self.region = None
