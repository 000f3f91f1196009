"""Copiers: move tensors into host buffers without stopping the training stream.

One protocol, three implementations:

* ``CudaStreamCopier``: device-to-host copies on a side CUDA stream into pinned
  shared host buffers, tracked with events; the training process learns that a
  copy landed by querying those events from its hooks, never by synchronizing.
* ``CpuStreamCopier`` (``cpu_stream.py``): the same stream model on the CPU. Copies
  run in order on a worker thread, an event is set when a copy is done, and "the
  compute stream waits on the event" becomes a host wait before the mutation it
  guards. CPU tests drive every fence through it.
* ``CpuCopier``: copies at the call with a plain memcpy; every ticket it returns
  has already landed, so no fence is ever needed. (The CPU default is the stream
  model, which overlaps the copy with forward and backward on a spare core.)

Fences, in the order a snapshot meets them (the engine places them; each copier
implements them for its stream model):

1. ``copy_async``: the copy reads the state only after the optimizer step that
   produced it has been applied (on CUDA: the side stream waits on the compute
   stream; on the CPU the host ran the step before the call).
2. ``fence_compute``: called before the next mutation of what a copy reads (the
   next optimizer step's pre-hook for parameters and optimizer state; after the
   step for replay's gradients, which the next iteration may write in place). On
   CUDA it is a device-side wait: the host runs on, and training stalls only if
   the copy outlasts forward+backward.
3. ``stage``: a clone on the compute stream (device-to-device on CUDA) for state
   that the next forward mutates (buffers), or that must be read later than its
   next mutation (replay's gradients on CUDA). The clone is kept alive by the
   ticket of the copy that reads it until that copy has landed.
4. Staging drains (stage mode): a staging region is overwritten only after every
   drain reading it has landed (``StagingArea`` fences them).
5. Boundary values (``copy_values_to_host``): a tensor lr or GradScaler's scale is
   cloned on the compute stream when captured, since the loop writes it in place
   (``scheduler.step()``, ``scaler.update()``) before any hook of ours runs again.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

# Device tensors below this size are gathered into one device scratch buffer and
# copied to the host in one transfer: each copy costs a few microseconds of launch
# and DMA set-up, and an optimizer has one 4-byte ``step`` tensor per parameter.
SMALL_COPY_BYTES = 64 * 1024


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
    done_event: Any = None  # a torch.cuda.Event, a threading.Event, or None (landed at the call)
    start_event: Any = None
    # Temporaries (clones, packing scratch) the copy still reads; dropped once it landed.
    keepalive: list[torch.Tensor] = field(default_factory=list)
    group_index: int | None = None  # the copy group this ticket carries, None for gradients
    fence_after_hook: int = -1  # the hook that enqueued it: hooks after that one fence it
    error: BaseException | None = None  # a copy that raised on a worker thread


class Copier(Protocol):
    """How snapshot bytes move from training tensors into host buffers."""

    # Host buffers must be page-locked (cudaHostRegister) for this copier's DMA.
    pins_host_memory: bool
    # A clone on the compute stream costs less than a fenced copy (HBM against PCIe):
    # replay then clones gradients and drains the clones without a fence.
    clone_is_cheap: bool

    def copy_async(
        self,
        sources: Sequence[torch.Tensor],
        destinations: Sequence[torch.Tensor],
        keepalive: Sequence[torch.Tensor] = (),
    ) -> CopyTicket: ...

    def stage(self, sources: Sequence[torch.Tensor]) -> list[torch.Tensor]: ...

    def is_device_resident(self, t: torch.Tensor) -> bool:
        """Whether copies of ``t`` go through the stream (a device tensor), not a copy at the call."""
        ...

    def fence_compute(self, ticket: CopyTicket) -> FenceResult: ...

    def poll(self, ticket: CopyTicket) -> bool: ...

    def wait(self, ticket: CopyTicket) -> None: ...

    def synchronize(self) -> None: ...

    def close(self) -> None: ...


def tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def copy_on_host(sources: Sequence[torch.Tensor], destinations: Sequence[torch.Tensor]) -> None:
    if sources:
        with torch.no_grad():
            torch._foreach_copy_(list(destinations), [s.detach() for s in sources])


@dataclass(frozen=True)
class PackedSpan:
    """Small copies whose destinations lie in one host buffer, gathered into one transfer.

    ``span`` is the host buffer's bytes from the first destination to the end of the
    last; ``scratch_offsets[k]`` is where source k goes inside a scratch buffer laid
    out like ``span``, so one copy of the scratch writes every destination at once.
    """

    span: torch.Tensor
    scratch_offsets: tuple[int, ...]
    sources: tuple[torch.Tensor, ...]


def plan_packed_copy(
    sources: Sequence[torch.Tensor], destinations: Sequence[torch.Tensor]
) -> tuple[PackedSpan | None, list[int]]:
    """Gather the small pairs whose destinations share one contiguous host buffer.

    Returns the packed span (or None) and the indices of the pairs left to copy one by one.
    Packing pays only where the span is mostly the destinations themselves (the plan lays
    a group's small entries out together); a sparse span is left unpacked.
    """
    small = [
        k
        for k, (s, d) in enumerate(zip(sources, destinations))
        if tensor_nbytes(d) <= SMALL_COPY_BYTES and d.is_contiguous() and s.dtype == d.dtype
    ]
    small_set = set(small)
    rest = [k for k in range(len(sources)) if k not in small_set]
    if len(small) < 2:
        return None, list(range(len(sources)))
    storage = destinations[small[0]].untyped_storage()
    if any(destinations[k].untyped_storage().data_ptr() != storage.data_ptr() for k in small):
        return None, list(range(len(sources)))
    base_ptr = storage.data_ptr()
    starts = [destinations[k].data_ptr() - base_ptr for k in small]
    ends = [st + tensor_nbytes(destinations[k]) for st, k in zip(starts, small)]
    first, last = min(starts), max(ends)
    payload = sum(e - s for s, e in zip(starts, ends))
    if last - first > 4 * payload + 64 * len(small):
        return None, list(range(len(sources)))
    span = torch.empty(0, dtype=torch.uint8, device=destinations[small[0]].device)
    span.set_(storage, first, (last - first,), (1,))
    packed = PackedSpan(
        span=span,
        scratch_offsets=tuple(st - first for st in starts),
        sources=tuple(sources[k] for k in small),
    )
    return packed, rest


def gather_into_scratch(packed: PackedSpan, device: torch.device) -> torch.Tensor:
    """A scratch buffer laid out like ``packed.span``, holding the small sources (one foreach copy)."""
    scratch = torch.empty(packed.span.numel(), dtype=torch.uint8, device=device)
    views = []
    for off, s in zip(packed.scratch_offsets, packed.sources):
        raw = scratch[off : off + tensor_nbytes(s)]
        views.append(raw.view(s.dtype).view(s.shape))
    with torch.no_grad():
        torch._foreach_copy_(views, [s.detach() for s in packed.sources])
    return scratch


class CpuCopier:
    """Copies at the call, with plain memcpy: the same engine logic with no stream at all."""

    pins_host_memory = False
    clone_is_cheap = False

    def copy_async(
        self,
        sources: Sequence[torch.Tensor],
        destinations: Sequence[torch.Tensor],
        keepalive: Sequence[torch.Tensor] = (),
    ) -> CopyTicket:
        start = time.perf_counter()
        copy_on_host(sources, destinations)
        end = time.perf_counter()
        nbytes = sum(tensor_nbytes(d) for d in destinations)
        return CopyTicket(nbytes=nbytes, enqueued_at_s=start, landed_at_s=end, copy_s=end - start)

    def stage(self, sources: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        # The copy happens at the call, before any later mutation: nothing to protect.
        return list(sources)

    def is_device_resident(self, t: torch.Tensor) -> bool:
        return False  # every copy happens at the call

    def fence_compute(self, ticket: CopyTicket) -> FenceResult:
        return FenceResult.NOT_NEEDED  # the copy already happened on the host

    def poll(self, ticket: CopyTicket) -> bool:
        return True

    def wait(self, ticket: CopyTicket) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def close(self) -> None:
        return None


class CudaStreamCopier:
    """Device-to-host copies on a side stream, fenced with CUDA events."""

    pins_host_memory = True
    clone_is_cheap = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.side_stream = torch.cuda.Stream(device=device)

    def after_side_stream_wait(self) -> None:
        """Runs on the side stream after fence 1, before the copies: a seam for tests to delay them."""

    def _wait_for_compute(self) -> None:
        # Fence 1: the side stream must not read the state before the optimizer
        # step queued on the compute stream has written it.
        self.side_stream.wait_stream(torch.cuda.current_stream(self.device))

    def copy_async(
        self,
        sources: Sequence[torch.Tensor],
        destinations: Sequence[torch.Tensor],
        keepalive: Sequence[torch.Tensor] = (),
    ) -> CopyTicket:
        enqueued = time.perf_counter()
        on_host = [k for k, s in enumerate(sources) if s.device.type == "cpu"]
        # Host-resident state (Adam's CPU step counter) is mutated by the host in
        # program order, so copying it now captures this version exactly.
        copy_on_host([sources[k] for k in on_host], [destinations[k] for k in on_host])
        on_device = [k for k, s in enumerate(sources) if s.device.type != "cpu"]
        dev_src = [sources[k] for k in on_device]
        dev_dst = [destinations[k] for k in on_device]
        self._wait_for_compute()
        start = torch.cuda.Event(enable_timing=True)
        done = torch.cuda.Event(enable_timing=True)
        held = list(keepalive)
        with torch.cuda.stream(self.side_stream), torch.no_grad():
            start.record(self.side_stream)
            self.after_side_stream_wait()
            packed, rest = plan_packed_copy(dev_src, dev_dst)
            if packed is not None:
                # Allocated on the side stream, so the allocator orders its reuse after
                # this copy; the ticket keeps it alive until the copy has landed.
                scratch = gather_into_scratch(packed, self.device)
                packed.span.copy_(scratch, non_blocking=True)
                held.append(scratch)
            for k in rest:
                dev_dst[k].copy_(dev_src[k].detach(), non_blocking=True)
            done.record(self.side_stream)
        nbytes = sum(tensor_nbytes(d) for d in destinations)
        return CopyTicket(nbytes=nbytes, enqueued_at_s=enqueued, done_event=done, start_event=start, keepalive=held)

    def is_device_resident(self, t: torch.Tensor) -> bool:
        return t.device.type != "cpu"

    def stage(self, sources: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Device-to-device clones on the compute stream, in order after the step that wrote them.

        No ``record_stream``: the ticket of the copy that reads a clone holds it until
        that copy's event has fired, so the allocator cannot reuse its memory earlier.
        """
        with torch.no_grad():
            return [s.detach().clone() for s in sources]

    def fence_compute(self, ticket: CopyTicket) -> FenceResult:
        """Make the compute stream wait for the copy (a device-side wait; the host runs on)."""
        if ticket.done_event is None or ticket.landed_at_s is not None:
            return FenceResult.NOT_NEEDED
        # Fence 2: the next mutation of what this copy reads (the optimizer's in-place
        # update, or the next iteration's gradients) must not start before it is read.
        torch.cuda.current_stream(self.device).wait_event(ticket.done_event)
        return FenceResult.WAITED_LANDED if ticket.done_event.query() else FenceResult.WAITED_IN_FLIGHT

    def poll(self, ticket: CopyTicket) -> bool:
        if ticket.landed_at_s is not None:
            return True
        if ticket.done_event is None or not ticket.done_event.query():
            return False
        self._mark_landed(ticket)
        return True

    def wait(self, ticket: CopyTicket) -> None:
        """Block the host until the copy landed: only from wait()/close(), never a hook."""
        if ticket.landed_at_s is None and ticket.done_event is not None:
            ticket.done_event.synchronize()
            self._mark_landed(ticket)

    def synchronize(self) -> None:
        """Block until every queued copy is done: before host buffers are unpinned or unmapped."""
        self.side_stream.synchronize()

    def close(self) -> None:
        self.synchronize()

    def _mark_landed(self, ticket: CopyTicket) -> None:
        ticket.landed_at_s = time.perf_counter()
        ticket.copy_s = ticket.start_event.elapsed_time(ticket.done_event) / 1000.0
        ticket.keepalive.clear()


def make_copier(device: torch.device) -> Copier:
    """The default copier for the device the state lives on.

    On the CPU, the stream model: its copies run on a spare core while forward and
    backward run (benchmarks/copier_compare.py: hooks 1.4 ms per checkpoint against
    20.7 ms for a copy in the hook, 172 MiB of state, the loop 6% faster).
    """
    if device.type == "cuda" and torch.cuda.is_available():
        return CudaStreamCopier(device)
    from .cpu_stream import CpuStreamCopier

    return CpuStreamCopier()


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
    read the new value, so each is first cloned on the compute stream (``stage``),
    ordered before those writes, and the side stream copies the clone.
    """
    device_resident = [copier.is_device_resident(t) for t in tensors]
    host = [
        torch.empty(t.shape, dtype=t.dtype, pin_memory=copier.pins_host_memory and resident)
        for t, resident in zip(tensors, device_resident)
    ]
    on_device = [k for k, resident in enumerate(device_resident) if resident]
    on_host = [k for k, resident in enumerate(device_resident) if not resident]
    copy_on_host([tensors[k] for k in on_host], [host[k] for k in on_host])
    if not on_device:
        return host, None
    clones = copier.stage([tensors[k] for k in on_device])
    return host, copier.copy_async(clones, [host[k] for k in on_device], keepalive=clones)
