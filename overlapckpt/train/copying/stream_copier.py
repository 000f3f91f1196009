"""``StreamCopier``: device-to-host copies on a side stream, fenced with events, over a device seam.

The copier behind the ``Copier`` protocol (``transfer.py``, whose docstring numbers the
fences it implements), and ``make_copier``, which picks its device for the device the state
lives on. Separate from the protocol, which every caller imports: only the builder, the tests and
the benchmarks name this implementation.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import torch

from ...errors import ConfigError, InternalError
from .device import StreamDevice, TensorRun
from .host_values import HostValues
from .packed_copy import packed_offsets, plan_packed_copy, views_of
from .transfer import Copier, CopyRoute, CopyTicket, FenceResult, tensor_nbytes

# A copy route keeps its packed scratch for the plan's life only up to this size; a larger
# span gets its scratch per copy, as a copy without a route does (device memory is the trainer's).
ROUTE_SCRATCH_MAX_BYTES = 64 << 20


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
        packed, rest = plan_packed_copy(dev_src, dev_dst) if dev.packs_small_copies else (None, list(range(len(dev_src))))
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

