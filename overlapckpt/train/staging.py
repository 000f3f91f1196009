"""Stage mode's staging area: device memory that holds groups 1..W-1 at version s while they drain.

Before step s+1 can mutate anything, the groups not yet copied are cloned
device-to-device (fast, HBM) into one staging region; the engine then drains one
group per step from it to the host slot, on the side stream, with no fence against
training (no training kernel touches the region).

* One region for all slots: the budget (``stage_budget_bytes``) is a cap on device
  memory for staging, whatever ``max_inflight`` is. A new snapshot that needs the
  region while an earlier one still drains from it has the engine enqueue the
  earlier one's remaining drains at once, and the compute stream waits for every
  drain before overwriting the region (fence 4).
* Sized to what the window needs, never to the budget. On CUDA, free device memory
  (``mem_get_info`` plus what the caching allocator holds unused) is checked before
  allocating, so a region that cannot fit raises ``ConfigError`` naming the bytes,
  not an out-of-memory error halfway through a hook.
* Freed once its last drain landed, unless ``keep=True`` (no allocation per checkpoint).
* State that lives on the host (a CPU ``step`` counter of a non-capturable Adam) is
  not staged: it is copied straight into the host slot at stage time, which is exact
  at version s, instead of a synchronizing host-to-device copy into the region.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from ..hostbuf import view_bytes
from .layout import StateLayout
from .plan import CopyPlan, align_bytes
from .transfer import Copier, CopyTicket, copy_on_host


def staged_entry_indices(plan: CopyPlan) -> list[int]:
    """The entries stage mode clones at the request: those of groups 1..W-1."""
    return [i for g in plan.groups[1:] for i in g.entry_indices]


def _on_training_device(t: torch.Tensor, device: torch.device) -> bool:
    # On a GPU run, state on the host (a CPU step counter) is not staged; on a CPU run everything is.
    return t.device.type == device.type


def _region_nbytes(entry_nbytes: list[int]) -> int:
    # Each entry starts aligned, as in the host slot, so every dtype views it in place.
    return sum(align_bytes(n) for n in entry_nbytes)


def _device_bytes_available(device: torch.device) -> int:
    free_bytes, _ = torch.cuda.mem_get_info(device)
    # The caching allocator's reserved-but-unused blocks are available to it too.
    return free_bytes + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


class StagingArea:
    """The one staging region, its budget, and the drains that still read it."""

    def __init__(self, device: torch.device, budget_bytes: int | None, keep: bool) -> None:
        self.device = device
        self.budget_bytes = budget_bytes
        self.keep = keep
        self.region: torch.Tensor | None = None
        self._drains: list[CopyTicket] = []  # drain copies that read the region and may not have landed

    def needed_bytes(self, plan: CopyPlan, layout: StateLayout) -> int:
        """Bytes the region needs for ``plan``: the entries of groups 1..W-1 on the training device."""
        return _region_nbytes(
            [layout.entries[i].nbytes for i in staged_entry_indices(plan) if _on_training_device(layout.live_tensors[i], self.device)]
        )

    def fits(self, needed_bytes: int) -> bool:
        return self.budget_bytes is None or needed_bytes <= self.budget_bytes

    def check(self, needed_bytes: int, window: int, state_nbytes: int) -> None:
        """Raise ConfigError if a region of ``needed_bytes`` is over budget or cannot be allocated."""
        if not self.fits(needed_bytes):
            raise ConfigError(
                f"stage mode needs {needed_bytes} bytes of staging for window {window} (groups 1..{window - 1} "
                f"of {state_nbytes} bytes of state), but stage_budget_bytes={self.budget_bytes}; raise "
                f"stage_budget_bytes to at least {needed_bytes}, use a smaller window, or use consistency='replay'"
            )
        if self.device.type == "cuda" and needed_bytes > 0:
            held = self.region.numel() if self.region is not None else 0
            available = _device_bytes_available(self.device) + held
            if needed_bytes > available:
                raise ConfigError(
                    f"stage mode needs {needed_bytes} bytes of device memory for staging (window {window}), but "
                    f"only {available} bytes are free on {self.device}; use a smaller window, "
                    "consistency='replay' (no device memory), or free device memory"
                )

    def stage(
        self, copier: Copier, plan: CopyPlan, layout: StateLayout, host_views: list[torch.Tensor]
    ) -> list[torch.Tensor | None]:
        """Clone groups 1..W-1 now, on the compute stream, in order after step s: version s.

        Returns, per entry, the staged tensor its drain copies from; None where the
        entry was copied to ``host_views`` at once (host-resident state) or is in group 0.
        The caller enqueued every drain still reading the region first.
        """
        staged: list[torch.Tensor | None] = [None] * len(layout.entries)
        later = staged_entry_indices(plan)
        if not later:
            return staged
        on_device = [i for i in later if _on_training_device(layout.live_tensors[i], self.device)]
        on_host = [i for i in later if not _on_training_device(layout.live_tensors[i], self.device)]
        copy_on_host([layout.live_tensors[i] for i in on_host], [host_views[i] for i in on_host])
        if not on_device:
            return staged
        needed = _region_nbytes([layout.entries[i].nbytes for i in on_device])
        self.check(needed, plan.window_steps, layout.nbytes)
        for ticket in self._drains:
            # Fence 4: the earlier snapshot's drains read this region on the side stream;
            # the compute stream must not overwrite it, nor reuse its memory once freed
            # below, before they are done.
            copier.fence_compute(ticket)
        self._drains = []
        if self.region is None or self.region.numel() < needed or (not self.keep and self.region.numel() != needed):
            self.region = None  # freed first, so the old and the new region are never both held
            self.region = torch.empty(needed, dtype=torch.uint8, device=self.device)
        cursor = 0
        region_views: list[torch.Tensor] = []
        for i in on_device:
            e = layout.entries[i]
            staged[i] = view = view_bytes(self.region, cursor, e.dtype, e.shape)
            region_views.append(view)
            cursor += align_bytes(e.nbytes)
        with torch.no_grad():
            torch._foreach_copy_(region_views, [layout.live_tensors[i].detach() for i in on_device])
        return staged

    def note_drain(self, ticket: CopyTicket) -> None:
        self._drains.append(ticket)

    def release_if_idle(self, copier: Copier) -> None:
        """Free the region once every drain reading it has landed (kept when ``keep``)."""
        self._drains = [t for t in self._drains if not copier.poll(t)]
        if not self._drains and not self.keep:
            self.region = None

    def release(self) -> None:
        self._drains = []
        self.region = None

