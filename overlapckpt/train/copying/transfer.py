"""Copiers: move tensors into host buffers without stopping the training stream.

One protocol, two implementations:

* ``StreamCopier``: the copier. Device-to-host copies on a side stream into pinned
  shared host buffers, tracked with events; the training process learns that a copy
  landed by querying those events from its hooks, never by synchronizing. It runs over
  a device seam (``device.py``) with three backends: CUDA (``cuda_device.py``), the plain
  CPU device CPU training runs (``cpu_device.py``: worker-thread streams over host
  memory), and a CUDA device emulated on the CPU (``emulated_device.py``), which every
  CPU test runs. So every line of logic below runs in the CPU tests.
* ``CpuCopier``: copies at the call with a plain memcpy; every ticket it returns has
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
version. Where its destination lies inside a packed span (below), the span's one DMA
would later write over it: its value is then captured at the call and written into the
slot once the DMA has landed.
"""

from __future__ import annotations

import enum
import operator
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ...errors import ConfigError, InternalError
from .device import StreamDevice, TensorRun, align_up
from .host_values import HostValues, copy_on_host

# Device tensors below this size are gathered into one device scratch buffer and
# copied to the host in one transfer: each copy costs a few microseconds of launch
# and DMA set-up, and an optimizer has one 4-byte ``step`` tensor per parameter.
SMALL_COPY_BYTES = 64 * 1024
# A copy route keeps its packed scratch for the plan's life only up to this size; a larger
# span gets its scratch per copy, as a copy without a route does (device memory is the trainer's).
ROUTE_SCRATCH_MAX_BYTES = 64 << 20
# Clones packed into one allocation start on this boundary, so every dtype views them in place.
CLONE_ALIGN_BYTES = 64


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


@dataclass(frozen=True)
class PackedSpan:
    """Small copies whose destinations lie in one host buffer, gathered into one transfer.

    ``span`` is the host buffer's bytes from the first destination to the end of the
    last; ``scratch_offsets[k]`` is where source k goes inside a scratch buffer laid
    out like ``span``, so one copy of the scratch writes every destination at once.
    The copy writes the whole span: the bytes between destinations too.
    """

    span: torch.Tensor
    scratch_offsets: tuple[int, ...]
    sources: tuple[torch.Tensor, ...]

    def covers(self, destination: torch.Tensor) -> bool:
        start = self.span.data_ptr()
        return start <= destination.data_ptr() < start + self.span.numel()


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


def views_of(block: torch.Tensor, offsets: Sequence[int], like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of the uint8 ``block`` at ``offsets``, shaped and typed like ``like`` (contiguous)."""
    return [block[off : off + tensor_nbytes(t)].view(t.dtype).view(t.shape) for off, t in zip(offsets, like)]


def packed_offsets(tensors: Sequence[torch.Tensor]) -> tuple[list[int], int]:
    """Aligned offsets of ``tensors`` packed one after another, and the bytes they take."""
    offsets, cursor = [], 0
    for t in tensors:
        offsets.append(cursor)
        cursor += align_up(tensor_nbytes(t), CLONE_ALIGN_BYTES)
    return offsets, cursor


class CpuCopier:
    """Copies at the call, with plain memcpy: the same engine logic with no stream at all."""

    pins_host_memory = False
    clone_is_cheap = False
    device = None

    def note_training_stream(self) -> None:
        return None

    def copy_async(
        self,
        sources: Sequence[torch.Tensor],
        destinations: Sequence[torch.Tensor],
        keepalive: Sequence[torch.Tensor] = (),
        route: CopyRoute | None = None,
    ) -> CopyTicket:
        start = time.perf_counter()
        copy_on_host(sources, destinations)
        end = time.perf_counter()
        nbytes = sum(tensor_nbytes(d) for d in destinations)
        return CopyTicket(nbytes=nbytes, enqueued_at_s=start, landed_at_s=end, copy_s=end - start)

    def route(
        self, sources: Sequence[torch.Tensor], destinations: Sequence[torch.Tensor], keep_sources: bool = False
    ) -> CopyRoute | None:
        return None  # one memcpy per tensor at the call: nothing to work out in advance

    def stage(self, sources: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        # The copy happens at the call, before any later mutation: nothing to protect.
        return list(sources)

    def clone_packed(self, sources: Sequence[torch.Tensor], dtype: torch.dtype, numel: int) -> torch.Tensor:
        with torch.no_grad():
            return torch.cat([s.reshape(-1) for s in sources]) if len(sources) != 1 else sources[0].reshape(-1).clone()

    def allocate_on_training_stream(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def copy_on_training_stream(self, destinations: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
        copy_on_host(sources, destinations)

    def device_free_bytes(self) -> int | None:
        return None

    def host_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def is_device_resident(self, t: torch.Tensor) -> bool:
        return False  # every copy happens at the call

    def fence_compute(self, ticket: CopyTicket) -> FenceResult:
        return FenceResult.NOT_NEEDED  # the copy already happened on the host

    def poll(self, ticket: CopyTicket) -> bool:
        return True

    def wait(self, ticket: CopyTicket) -> None:
        return None

    def await_landing(self, ticket: CopyTicket, timeout_s: float) -> bool:
        return True  # landed at the call

    def synchronize(self) -> None:
        return None

    def close(self) -> None:
        return None


class StreamCopier:
    """Device-to-host copies on a side stream, fenced with events, over a ``StreamDevice``."""

    def __init__(self, device: StreamDevice) -> None:
        self.device = device
        self.pins_host_memory = device.pins_host_memory
        self.clone_is_cheap = device.clone_is_cheap
        self.side_stream = device.new_stream()
        self.training_stream = device.current_stream()

    def note_training_stream(self) -> None:
        self.training_stream = self.device.current_stream()

    def after_side_stream_wait(self) -> None:
        """Runs on the side stream after fence 1, before the copies: a seam for tests to delay them."""

    def copy_async(
        self,
        sources: Sequence[torch.Tensor],
        destinations: Sequence[torch.Tensor],
        keepalive: Sequence[torch.Tensor] = (),
        route: CopyRoute | None = None,
    ) -> CopyTicket:
        if route is None:
            # A route for this copy only: its scratch is dropped with it right after, on the side
            # stream it was allocated on, so the allocator hands that memory to later work there only.
            route = self._make_route(sources, destinations, keep_sources=False, scratch_limit_bytes=None)
            if route is None:
                raise InternalError("a copy route without a scratch limit was refused")
        return self._copy_routed(sources, route, keepalive)

    def route(
        self, sources: Sequence[torch.Tensor], destinations: Sequence[torch.Tensor], keep_sources: bool = False
    ) -> CopyRoute | None:
        """Work out once what ``copy_async`` would per copy; the scratch is allocated here, on the side stream.

        ``keep_sources``: the caller copies these same tensors every time (they are held by the route).
        None where the packed span is larger than a route may keep (``ROUTE_SCRATCH_MAX_BYTES``).
        """
        return self._make_route(sources, destinations, keep_sources, scratch_limit_bytes=ROUTE_SCRATCH_MAX_BYTES)

    def _make_route(
        self,
        sources: Sequence[torch.Tensor],
        destinations: Sequence[torch.Tensor],
        keep_sources: bool,
        scratch_limit_bytes: int | None,
    ) -> CopyRoute | None:
        dev = self.device
        device_indices = tuple(k for k, s in enumerate(sources) if dev.is_resident(s))
        on_device = set(device_indices)
        host_indices = [k for k in range(len(sources)) if k not in on_device]
        dev_src = [sources[k].detach() for k in device_indices]
        dev_dst = [destinations[k] for k in device_indices]
        packed, rest = plan_packed_copy(dev_src, dev_dst)
        scratch = None
        scratch_views: list[torch.Tensor] = []
        packed_indices: tuple[int, ...] = ()
        if packed is not None:
            if scratch_limit_bytes is not None and packed.span.numel() > scratch_limit_bytes:
                return None  # too large to keep: copies without a route take their scratch per copy
            rest_set = set(rest)
            packed_indices = tuple(device_indices[j] for j in range(len(device_indices)) if j not in rest_set)
            # Allocated on the side stream, where every use of it is queued: each copy's gather
            # into it runs after the previous copy's DMA out of it, in that stream's order.
            with dev.stream_context(self.side_stream):
                scratch = dev.empty(packed.span.numel())
            scratch_views = views_of(scratch, packed.scratch_offsets, packed.sources)
        deferred = [k for k in host_indices if packed is not None and packed.covers(destinations[k])]
        deferred_set = set(deferred)
        now = [k for k in host_indices if k not in deferred_set]
        return CopyRoute(
            nbytes=sum(tensor_nbytes(d) for d in destinations),
            packed_indices=packed_indices,
            every_source_packed=packed_indices == tuple(range(len(sources))),
            scratch=scratch,
            scratch_views=TensorRun(scratch_views),
            rest_indices=tuple(device_indices[j] for j in rest),
            rest_destinations=TensorRun(dev_dst[j] for j in rest),
            host_now_indices=tuple(now),
            host_now=HostValues([sources[k] for k in now], [destinations[k] for k in now]) if now else None,
            host_deferred_indices=tuple(deferred),
            host_deferred=HostValues([sources[k] for k in deferred], [destinations[k] for k in deferred]) if deferred else None,
            host_now_sources=TensorRun(sources[k] for k in now) if keep_sources else None,
            host_deferred_sources=TensorRun(sources[k] for k in deferred) if keep_sources else None,
            sources=TensorRun(sources) if keep_sources else None,
            packed_sources=TensorRun(sources[k] for k in packed_indices) if keep_sources else None,
            rest_sources=TensorRun(sources[device_indices[j]] for j in rest) if keep_sources else None,
            span_run=TensorRun([] if packed is None else [packed.span]),
            scratch_run=TensorRun([] if scratch is None else [scratch]),
            made_from=sources if keep_sources and isinstance(sources, TensorRun) else None,
        )

    def _copy_routed(self, sources: Sequence[torch.Tensor], route: CopyRoute, keepalive: Sequence[torch.Tensor]) -> CopyTicket:
        """``copy_async`` along a route: the same fences and launches, none of the per-tensor planning."""
        dev = self.device
        enqueued = time.perf_counter()
        kept = route.kept_sources(sources)
        # Fence 1: the side stream must not read the state before the optimizer step
        # queued on the training stream has written it.
        dev.wait_stream(self.side_stream, self.training_stream)
        with dev.stream_context(self.side_stream):
            start = dev.record_event(self.side_stream)
            self.after_side_stream_wait()
            if route.scratch is not None:
                if kept and route.packed_sources is not None:
                    packed: Sequence[torch.Tensor] = route.packed_sources
                else:
                    packed = sources if route.every_source_packed else [sources[k] for k in route.packed_indices]
                dev.copy_(route.scratch_views, packed)
                dev.copy_(route.span_run, route.scratch_run)
            if route.rest_indices:
                rest = route.rest_sources if kept and route.rest_sources is not None else [sources[k] for k in route.rest_indices]
                dev.copy_(route.rest_destinations, rest)
            done = dev.record_event(self.side_stream)
        # Host-resident state is written by the host in program order: exact now, or kept
        # now and written once the span's DMA (which covers its bytes) has landed.
        # Grouped (host_values.py): no work per tensor, whatever the count (an optimizer has a step counter per parameter).
        deferred: tuple[tuple[HostValues, torch.Tensor | list[torch.Tensor]], ...] = ()
        if route.host_deferred is not None:
            later = route.host_deferred_sources if kept and route.host_deferred_sources is not None else [sources[k] for k in route.host_deferred_indices]
            deferred = ((route.host_deferred, route.host_deferred.read(later)),)
        if route.host_now is not None:
            now = route.host_now_sources if kept and route.host_now_sources is not None else [sources[k] for k in route.host_now_indices]
            route.host_now.copy_now(now)
        return CopyTicket(
            nbytes=route.nbytes, enqueued_at_s=enqueued, done_event=done, start_event=start, keepalive=list(keepalive),
            deferred_host_writes=deferred,
        )

    def is_device_resident(self, t: torch.Tensor) -> bool:
        return self.device.is_resident(t)

    def stage(self, sources: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Clones on the training stream, in order after the step that wrote them, packed in one allocation.

        No ``record_stream``: the ticket of the copy that reads a clone holds it until
        that copy's event has fired, so the allocator cannot reuse its memory earlier.
        """
        out = [s.detach() for s in sources]
        resident = [self.device.is_resident(s) for s in sources]
        device_side = [k for k, r in enumerate(resident) if r]
        if device_side:
            like = [out[k] for k in device_side]
            offsets, total = packed_offsets(like)
            with self.device.stream_context(self.training_stream):
                block = self.device.empty(total)
                clones = views_of(block, offsets, like)
                self.device.copy_(clones, like)
            for k, c in zip(device_side, clones):
                out[k] = c
        for k, r in enumerate(resident):
            if not r:
                out[k] = out[k].clone()  # the host's own program order
        return out

    def clone_packed(self, sources: Sequence[torch.Tensor], dtype: torch.dtype, numel: int) -> torch.Tensor:
        """``stage`` of many tensors of one dtype as one grouped clone: no per-tensor Python.

        Queued on the training stream after the step that wrote the sources, so it reads
        exactly what that step left; nothing writes the clone later, so the copy that drains
        it needs no fence, and holding the returned tensor (a ticket's keepalive) keeps it.
        """
        with self.device.stream_context(self.training_stream):
            return self.device.flatten(sources, dtype, numel)

    def allocate_on_training_stream(self, nbytes: int) -> torch.Tensor:
        with self.device.stream_context(self.training_stream):
            return self.device.empty(nbytes)

    def copy_on_training_stream(self, destinations: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
        with self.device.stream_context(self.training_stream):
            # Undetached: the device copies without autograd, and a TensorRun keeps its per-tensor work.
            self.device.copy_(destinations, sources)

    def device_free_bytes(self) -> int | None:
        return self.device.mem_get_info()[0]

    def host_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return self.device.host_empty(shape, dtype)

    def fence_compute(self, ticket: CopyTicket) -> FenceResult:
        """Make the training stream wait for the copy (a device-side wait; the host runs on)."""
        if ticket.done_event is None or ticket.landed_at_s is not None:
            return FenceResult.NOT_NEEDED
        in_flight = not self.device.event_done(ticket.done_event)
        # Fence 2: the next mutation of what this copy reads (the optimizer's in-place
        # update, or the next iteration's gradients) must not start before it is read.
        self.device.wait_event(self.training_stream, ticket.done_event)
        return FenceResult.WAITED_IN_FLIGHT if in_flight else FenceResult.WAITED_LANDED

    def poll(self, ticket: CopyTicket) -> bool:
        if ticket.landed_at_s is not None:
            return True
        if ticket.done_event is None or not self.device.event_done(ticket.done_event):
            return False
        self._mark_landed(ticket)
        return True

    def await_landing(self, ticket: CopyTicket, timeout_s: float) -> bool:
        """From a thread of its own, never a hook: whether the copy landed within ``timeout_s`` (hurries nothing).

        Its landing is recorded by the next ``poll``, on the thread that owns the snapshot.
        """
        if ticket.landed_at_s is not None or ticket.done_event is None:
            return True
        return self.device.await_event(ticket.done_event, timeout_s)

    def wait(self, ticket: CopyTicket) -> None:
        """Block the host until the copy landed: only from wait()/close() and rare paths, never a hook's routine."""
        if ticket.landed_at_s is None and ticket.done_event is not None:
            self.device.synchronize_event(ticket.done_event)
            self._mark_landed(ticket)

    def synchronize(self) -> None:
        """Block until every queued copy is done: before host buffers are unpinned or unmapped."""
        self.device.synchronize_stream(self.side_stream)

    def close(self) -> None:
        self.synchronize()
        self.device.close()

    def _mark_landed(self, ticket: CopyTicket) -> None:
        ticket.landed_at_s = time.perf_counter()
        ticket.copy_s = self.device.elapsed_s(ticket.start_event, ticket.done_event)
        # The span's DMA is done: the host-resident values it wrote over go back in.
        for host_values, values in ticket.deferred_host_writes:
            host_values.write(values)
        ticket.deferred_host_writes = ()
        ticket.keepalive.clear()


# "emulated": CPU training's copier runs on the CUDA emulation instead of the plain CPU device
# (the tests' default: tests/conftest.py sets it, and their subprocesses inherit it).
CPU_DEVICE_ENV = "OVERLAPCKPT_CPU_DEVICE"


def make_copier(device: torch.device) -> Copier:
    """The default copier for the device the state lives on: a side stream on CUDA, the plain CPU device elsewhere.

    On the CPU the side stream is a worker thread (``cpu_device.py``): its copies run on a
    spare core while forward and backward run (benchmarks/copier_compare.py).
    """
    if device.type == "cuda" and torch.cuda.is_available():
        from .cuda_device import CudaDevice

        return StreamCopier(CudaDevice(device))
    choice = os.environ.get(CPU_DEVICE_ENV, "plain")
    if choice == "emulated":
        from .emulated_device import EmulatedDevice

        return StreamCopier(EmulatedDevice())
    if choice != "plain":
        raise ConfigError(f"{CPU_DEVICE_ENV}={choice!r} is not a CPU device; use 'plain' (the default) or 'emulated' (the tests' CUDA model)")
    from .cpu_device import CpuDevice

    return StreamCopier(CpuDevice())


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
