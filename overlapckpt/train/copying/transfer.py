"""Copiers: move tensors into host buffers without stopping the training stream.

One protocol (this module, with the records every copier and its callers share), two
implementations:

* ``StreamCopier`` (``stream_copier.py``): the copier. Device-to-host copies on a side stream into pinned
  shared host buffers, tracked with events; the training process learns that a copy
  landed by querying those events from its hooks, never by synchronizing. It runs over
  a device seam (``device.py``) with three backends: CUDA (``cuda_device.py``), the plain
  CPU device CPU training runs (``cpu_device.py``: worker-thread streams over host
  memory), and a CUDA device emulated on the CPU (``emulated_device.py``), which every
  CPU test runs. So every line of its logic runs in the CPU tests.
* ``CpuCopier`` (``cpu_copier.py``): copies at the call with a plain memcpy; every ticket it returns has
  already landed, so no fence is ever needed.

Fences, in the order a snapshot meets them (the engine places them; the copier
implements them over the device):

1. ``copy_async``: the copy reads the state only after the optimizer step that
   produced it: the side stream waits on the training stream, the one the step was
   queued on (recorded at each hook, ``note_training_stream``: a ``request()`` made
   outside the loop's stream context must not order the copy against another stream).
2. ``fence_compute``: called before the next mutation of what a copy reads (the
   next optimizer step's pre-hook for parameters and optimizer state; after the
   step for replay's gradients, which the next iteration may write in place). A
   device-side wait: the host runs on, and training stalls only if the copy outlasts
   forward+backward.
3. ``stage``: a clone on the training stream (device-to-device) for state that the
   next forward mutates (buffers), or that must be read later than its next mutation
   (replay's gradients with ``clone_is_cheap``). The clone is kept alive by the ticket
   of the copy that reads it until that copy has landed, and no longer: the engine
   polls every ticket in every hook, so each clone goes when its own copy lands.
4. Staging drains (stage mode): a staging region is overwritten only after every
   drain reading it has landed (``StagingArea`` fences them).
5. Boundary values (``copy_values_to_host``): a tensor lr or GradScaler's scale is
   cloned on the training stream when captured, since the loop writes it in place
   (``scheduler.step()``, ``scaler.update()``) before any hook of ours runs again.

Host-resident state (Adam's ``step`` counter of a non-fused optimizer on CUDA) is
written by the host in program order, so it is copied at the call, exactly at this
version. Where its destination lies inside a packed span (``packed_copy.py``), the span's one DMA
would later write over it: its value is then captured at the call and written into the
slot once the DMA has landed.
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from .device import StreamDevice, TensorRun
from .host_values import HostValues, copy_on_host


class FenceResult(enum.Enum):
    """What ``fence_compute`` did."""

    NOT_NEEDED = "not-needed"  # the copy had landed, or the copier copies at the call
    WAITED_LANDED = "waited-landed"  # a wait was inserted; the copy was done by then
    WAITED_IN_FLIGHT = "waited-in-flight"  # a wait was inserted while the copy was still running


@dataclass
class CopyTicket:
    """One batch of copies queued together; ``landed_at_s`` is set once they are on the host."""

    nbytes: int
    enqueued_at_s: float
    landed_at_s: float | None = None
    copy_s: float | None = None
    done_event: Any = None  # the device's event after the batch, or None (landed at the call)
    start_event: Any = None
    # Temporaries (clones) the copy still reads; dropped once it landed, so they are freed then.
    keepalive: list[torch.Tensor] = field(default_factory=list)
    # Host-resident values inside a packed span, read at the call: written once the span's DMA landed.
    deferred_host_writes: tuple[tuple[HostValues, torch.Tensor | list[torch.Tensor]], ...] = ()
    group_index: int | None = None  # the copy group this ticket carries, None for gradients
    fence_after_hook: int = -1  # the hook that enqueued it: hooks after that one fence it


class Copier(Protocol):
    """How snapshot bytes move from training tensors into host buffers."""

    # Host buffers must be page-locked (``register_host``) for this copier's DMA.
    pins_host_memory: bool
    # A clone on the training stream costs less than a fenced copy (HBM against PCIe):
    # replay then clones gradients and drains the clones without a fence.
    clone_is_cheap: bool
    @property
    def device(self) -> StreamDevice | None:
        """The device the copies come from (None: there is none, copies happen at the call)."""
        ...

    def note_training_stream(self) -> None:
        """At the start of each hook: the stream the optimizer step is queued on."""
        ...

    def copy_async(
        self,
        sources: Sequence[torch.Tensor],
        destinations: Sequence[torch.Tensor],
        keepalive: Sequence[torch.Tensor] = (),
        route: CopyRoute | None = None,
    ) -> CopyTicket: ...

    def route(
        self, sources: Sequence[torch.Tensor], destinations: Sequence[torch.Tensor], keep_sources: bool = False
    ) -> CopyRoute | None:
        """The per-tensor work of copying such sources into ``destinations``, done once (None: nothing to save)."""
        ...

    def stage(self, sources: Sequence[torch.Tensor]) -> list[torch.Tensor]: ...

    def clone_packed(self, sources: Sequence[torch.Tensor], dtype: torch.dtype, numel: int) -> torch.Tensor:
        """One fresh 1-D tensor holding device-resident ``sources`` (all of ``dtype``, ``numel`` elements
        together) one after another, cloned on the training stream in one call (``stage``, packed)."""
        ...

    def allocate_on_training_stream(self, nbytes: int) -> torch.Tensor:
        """Device memory whose writes and reuse are ordered on the training stream (stage mode's region)."""
        ...

    def copy_on_training_stream(self, destinations: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None: ...

    def device_free_bytes(self) -> int | None:
        """Device memory a new allocation can get without freeing the allocator's cache (None: no device)."""
        ...

    def host_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A host tensor that a copy from the device may target without a host sync."""
        ...

    def is_device_resident(self, t: torch.Tensor) -> bool:
        """Whether copies of ``t`` go through the stream (a device tensor), not a copy at the call."""
        ...

    def fence_compute(self, ticket: CopyTicket) -> FenceResult: ...

    def poll(self, ticket: CopyTicket) -> bool: ...

    def wait(self, ticket: CopyTicket) -> None: ...

    def await_landing(self, ticket: CopyTicket, timeout_s: float) -> bool: ...

    def synchronize(self) -> None: ...

    def close(self) -> None: ...


def tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass(eq=False)
class CopyRoute:
    """One group's copies worked out once per plan and slot, so that a step's copy is grouped launches only.

    Made by ``StreamCopier.route`` from a first set of sources and the slot's destinations;
    valid for any sources of the same placement, dtypes and shapes in the same order (the
    plan's live tensors, or its parameters' gradients, step after step), into the same
    destinations. Without it, every copy redoes the per-tensor work below: which sources
    are device-resident, which destinations pack into one span, the scratch views.
    """

    nbytes: int
    packed_indices: tuple[int, ...]  # of those, the ones gathered into the scratch
    every_source_packed: bool  # packed_indices is every source, in order: pass the sources as they come
    scratch: torch.Tensor | None  # device memory laid out like the span (the host bytes it lands in), on the side stream
    scratch_views: TensorRun  # where each packed source goes inside the scratch
    rest_indices: tuple[int, ...]  # device sources copied one by one
    rest_destinations: TensorRun
    host_now_indices: tuple[int, ...]  # host-resident sources copied at the call
    host_now: HostValues | None
    host_deferred_indices: tuple[int, ...]  # host-resident sources inside the span: written after its DMA
    host_deferred: HostValues | None
    host_now_sources: TensorRun | None = None  # the kept sources of the host copies
    host_deferred_sources: TensorRun | None = None
    # The first copy's sources, when the caller's sources are the same tensors on every copy
    # (the plan's live tensors): passed instead, so a device keeps their per-tensor work too.
    sources: TensorRun | None = None
    packed_sources: TensorRun | None = None  # of those, the ones gathered into the scratch
    rest_sources: TensorRun | None = None  # and the ones copied one by one
    span_run: TensorRun = field(default_factory=TensorRun)  # [span] and [scratch], as runs: the span's one DMA
    scratch_run: TensorRun = field(default_factory=TensorRun)
    # The caller's own run the route was made from (a run is never changed after it is made):
    # passing it again is the same tensors, known without comparing tens of thousands of them.
    made_from: TensorRun | None = None

    def kept_sources(self, sources: Sequence[torch.Tensor]) -> bool:
        """Whether ``sources`` are the very tensors the route keeps (identity, compared in C)."""
        kept = self.sources
        if kept is not None and sources is self.made_from:
            return True
        return kept is not None and len(kept) == len(sources) and all(map(operator.is_, kept, sources))



def copy_values_to_host(
    copier: Copier, tensors: Sequence[torch.Tensor]
) -> tuple[list[torch.Tensor], CopyTicket | None]:
    """Host copies of small tensors (a tensor lr, GradScaler's scale) without a host sync.

    ``.item()`` or ``.to("cpu")`` of a device tensor waits for the device; here device
    tensors travel through the copier (read the host copy only once the ticket landed)
    and host tensors are copied at once.

    Fence 5: the loop mutates these values in place right after they are captured,
    before any hook of ours runs again (``scheduler.step()`` fills a tensor lr,
    ``scaler.update()`` writes GradScaler's scale). A copy on the side stream could
    read the new value, so each is first cloned on the training stream (``stage``),
    ordered before those writes, and the side stream copies the clone.
    """
    device_resident = [copier.is_device_resident(t) for t in tensors]
    host = [
        copier.host_empty(tuple(t.shape), t.dtype) if resident else torch.empty(t.shape, dtype=t.dtype)
        for t, resident in zip(tensors, device_resident)
    ]
    on_device = [k for k, resident in enumerate(device_resident) if resident]
    on_host = [k for k, resident in enumerate(device_resident) if not resident]
    copy_on_host([tensors[k] for k in on_host], [host[k] for k in on_host])
    if not on_device:
        return host, None
    clones = copier.stage([tensors[k] for k in on_device])
    return host, copier.copy_async(clones, [host[k] for k in on_device], keepalive=clones)
