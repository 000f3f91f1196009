"""Copiers: move tensors into host buffers without stopping the training stream.

``CudaStreamCopier`` queues device-to-host copies on a side CUDA stream into pinned
shared host buffers and tracks them with events; the training process learns that a
copy landed by polling those events from its hooks, never by synchronizing.
``CpuCopier`` has the same interface; on the CPU a copy is a plain memcpy done at
the call, so every ticket it returns has already landed.

Fences, in the order a snapshot meets them:

1. ``copy_async``: the side stream waits on the compute stream, so the copy reads
   the state only after the optimizer step that produced it has been applied.
2. ``fence_compute``: called from the next step's pre-hook; the compute stream
   waits on the copy's event, so the optimizer's in-place update cannot overwrite
   a tensor the side stream is still reading. It is a device-side wait: the host
   runs on, and training stalls only if the copy outlasts forward+backward.
   Replay's gradient copies are fenced after the step they feed (before it, for
   an optimizer that writes gradients in its step).
3. ``stage``: a device-to-device clone on the compute stream, for state that the
   next forward mutates (buffers) or the staged mode; the clone is handed to the
   side stream with ``record_stream`` so its memory is not reused under the copy.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


@dataclass
class CopyTicket:
    """One batch of copies queued together; ``landed_at_s`` is set once they are on the host."""

    nbytes: int
    enqueued_at_s: float
    landed_at_s: float | None = None
    copy_s: float | None = None
    done_event: object | None = None
    start_event: object | None = None
    # Temporaries (staged clones) that the side stream still reads; dropped once landed.
    keepalive: list[torch.Tensor] = field(default_factory=list)
    group_index: int | None = None  # the copy group this ticket carries, None for gradients
    fence_after_hook: int = -1  # the hook that enqueued it: hooks after that one fence it


def _split_by_device(
    sources: list[torch.Tensor], destinations: list[torch.Tensor]
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[tuple[torch.Tensor, torch.Tensor]]]:
    on_host, on_device = [], []
    for s, d in zip(sources, destinations):
        (on_device if s.device.type != "cpu" else on_host).append((s, d))
    return on_host, on_device


def _copy_on_host(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    if pairs:
        with torch.no_grad():
            torch._foreach_copy_([d for _, d in pairs], [s.detach() for s, _ in pairs])


class CpuCopier:
    """Copies at the call, with plain memcpy: the same engine logic without CUDA."""

    is_async = False

    def copy_async(
        self, sources: list[torch.Tensor], destinations: list[torch.Tensor], keepalive: list[torch.Tensor] | None = None
    ) -> CopyTicket:
        start = time.perf_counter()
        _copy_on_host(list(zip(sources, destinations)))
        end = time.perf_counter()
        nbytes = sum(d.numel() * d.element_size() for d in destinations)
        return CopyTicket(nbytes=nbytes, enqueued_at_s=start, landed_at_s=end, copy_s=end - start)

    def stage(self, sources: list[torch.Tensor]) -> list[torch.Tensor]:
        """Host clones: the CPU twin of a device-to-device staging copy."""
        with torch.no_grad():
            return [s.detach().clone() for s in sources]

    def fence_compute(self, ticket: CopyTicket) -> bool:
        return False  # the copy already happened on the host

    def poll(self, ticket: CopyTicket) -> bool:
        return True

    def wait(self, ticket: CopyTicket) -> None:
        return None


class CudaStreamCopier:
    """Device-to-host copies on a side stream, fenced with CUDA events."""

    is_async = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.side_stream = torch.cuda.Stream(device=device)

    def copy_async(
        self, sources: list[torch.Tensor], destinations: list[torch.Tensor], keepalive: list[torch.Tensor] | None = None
    ) -> CopyTicket:
        on_host, on_device = _split_by_device(sources, destinations)
        enqueued = time.perf_counter()
        # Host-resident state (Adam's CPU step counter) is mutated by the host in
        # program order, so copying it now captures this version exactly.
        _copy_on_host(on_host)
        compute = torch.cuda.current_stream(self.device)
        # Fence 1: the side stream must not read the state before the optimizer
        # step queued on the compute stream has written it.
        self.side_stream.wait_stream(compute)
        start = torch.cuda.Event(enable_timing=True)
        done = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.side_stream), torch.no_grad():
            start.record(self.side_stream)
            for s, d in on_device:
                d.copy_(s.detach(), non_blocking=True)
            done.record(self.side_stream)
        nbytes = sum(d.numel() * d.element_size() for d in destinations)
        return CopyTicket(
            nbytes=nbytes, enqueued_at_s=enqueued, done_event=done, start_event=start, keepalive=list(keepalive or [])
        )

    def stage(self, sources: list[torch.Tensor]) -> list[torch.Tensor]:
        """Device-to-device clones on the compute stream, safe from the next mutation."""
        with torch.no_grad():
            clones = [s.detach().clone() for s in sources]
        for c in clones:
            if c.device.type != "cpu":
                # The side stream reads the clone later; without this the caching
                # allocator could hand its memory to the compute stream once the
                # Python reference is dropped, before the copy has read it.
                c.record_stream(self.side_stream)
        return clones

    def fence_compute(self, ticket: CopyTicket) -> bool:
        """Make the compute stream wait for the copy; True if the copy was still in flight."""
        if ticket.done_event is None or ticket.landed_at_s is not None:
            return False
        # Fence 2: the next optimizer step updates parameters and optimizer state in
        # place; it must not start before the side stream has read them.
        torch.cuda.current_stream(self.device).wait_event(ticket.done_event)
        return not ticket.done_event.query()

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

    def _mark_landed(self, ticket: CopyTicket) -> None:
        ticket.landed_at_s = time.perf_counter()
        ticket.copy_s = ticket.start_event.elapsed_time(ticket.done_event) / 1000.0
        ticket.keepalive.clear()


def make_copier(device: torch.device) -> CpuCopier | CudaStreamCopier:
    """The copier for the device the state lives on."""
    if device.type == "cuda" and torch.cuda.is_available():
        return CudaStreamCopier(device)
    return CpuCopier()
