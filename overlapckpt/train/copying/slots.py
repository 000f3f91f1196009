"""Host slots: shared buffers allocated once, off the critical path, mapped by the writer, reused.

A slot holds one snapshot's bytes, laid out by its plan, and in replay mode a
second buffer for the gradients its window logs. At most ``max_inflight`` slots
exist; a request that finds none free waits (the engine counts a deferral).
``max_inflight="auto"`` sizes the pool when the state's size is known
(``auto_slot_count``): two slots for a small state in one process, else one.

Allocation is slow: reserving the pages of a large shared file, faulting them into
this process's page tables and, on CUDA, page-locking them (``cudaHostRegister``)
takes seconds for a 12 GB state. ``preallocate`` does it on a background thread as
soon as the state's size is known (at construction, or right after the first
optimizer step), sized for the widest window, so no hook pays for it. Only the
training thread talks to the writer: buffers are announced once the thread is done.
A hook that needs a slot before then waits for the thread (a request right after
the first step); a state that grows past the slot is reallocated in the hook, and
that is the one remaining allocation on the critical path.

Every buffer is announced to the writer, which maps the same file; once the writer
says it has mapped a buffer, its file name is unlinked.

A slot whose snapshot was dropped (its writer died, its window was abandoned) may still
have copies queued into it. It is free for the next snapshot at once (that one's copies
queue behind them on the same stream, and the writer reads only after they landed), but
it is unregistered and unmapped only once those copies have landed: a DMA into memory
already unmapped would write into whatever the address holds next.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from ... import protocol as p
from ...errors import OverlapCkptError
from ...hostbuf import HostPinner, SharedHostBuffer
from ..writer_client.client import WriterClient
from ..writer_client.link import WriterLink
from .device import TensorRun
from .landing import OwnedLandingPage
from .layout import StateLayout
from .plan import CopyPlan
from .transfer import Copier, CopyRoute, CopyTicket

# A background allocation that takes longer than this is stuck (a full /dev/shm blocks no call, it fails).
_PREALLOCATE_TIMEOUT_S = 600.0
# max_inflight="auto" keeps a second slot where one slot (snapshot and logged gradients) is at most this.
# A small state's persist (a tiny model's: about 20 ms, its fsync included) can outlast `every` short
# steps; with one slot the next replay window then opens late and is cut to 1. Two slots of this size
# cost little host memory; above it, a second copy of the state is the user's call (max_inflight=2).
AUTO_SECOND_SLOT_MAX_BYTES = 256 << 20


def auto_slot_count(slot_nbytes: int, grad_nbytes: int, distributed: bool) -> int:
    """How many slots ``max_inflight="auto"`` keeps for a state whose slot takes these bytes.

    One in a distributed run: the ranks' states differ in size (pipeline stages, uneven
    shards), and a rank with fewer slots would wait for one at a step where the others
    start, so the ranks would hold different versions.
    """
    if distributed:
        return 1
    return 2 if slot_nbytes + grad_nbytes <= AUTO_SECOND_SLOT_MAX_BYTES else 1


@dataclass(eq=False)
class GroupTensors:
    """One copy group's tensors, in the order its copy takes them."""

    indices: tuple[int, ...]  # entry indices
    sources: TensorRun  # live tensors (or staged views) of those entries: a run, never changed once made
    destinations: list[torch.Tensor]  # their views in the slot
    buffer_positions: tuple[int, ...]  # positions in sources of buffers, which are cloned before each copy
    staged_from: list[torch.Tensor | None] | None = None  # the staged views the sources were taken from


@dataclass
class HostSlot:
    """Host memory for one snapshot, reused for every checkpoint that lands in it."""

    buffer_id: int
    buffer: SharedHostBuffer
    grad_buffer_id: int | None = None
    grad_buffer: SharedHostBuffer | None = None  # replay: the gradients the window logs
    busy: bool = False
    # Copies of a dropped snapshot that may still write into this slot: awaited before it is unmapped.
    pending: list[CopyTicket] = field(default_factory=list)
    # Destination views for each entry, cached per plan: building them costs host time.
    views_key: tuple[int, int] | None = None  # (layout fingerprint, window) of the cached views
    views: list[torch.Tensor] = field(default_factory=list)
    # The copy routes into this slot (per copy group, per logged gradient step), for the cached views'
    # plan: they hold views of this slot's buffers, so they go when the views or a buffer go.
    routes: dict[tuple[object, ...], CopyRoute | None] = field(default_factory=dict)
    # Each copy group's sources and destinations under the cached views' plan, per route key:
    # gathered on the group's first copy, so that later copies do no Python per tensor.
    group_tensors: dict[tuple[object, ...], GroupTensors] = field(default_factory=dict)
    # A pipelined copy's batches of each group, in slot order (snapshot_copies.py), per group key.
    batches: dict[tuple[object, ...], object] = field(default_factory=dict)

    def entry_views(self, plan: CopyPlan, layout: StateLayout) -> list[torch.Tensor]:
        """Where each entry of ``layout`` lands in this slot under ``plan``."""
        key = (plan.fingerprint, plan.window_steps)
        if self.views_key != key or len(self.views) != len(layout.entries):
            self.views = [self.buffer.view(off, e.dtype, e.shape) for e, off in zip(layout.entries, plan.offsets)]
            self.views_key = key
            self.forget_routes()
        return self.views

    def forget_routes(self) -> None:
        """Drop what holds views of this slot's buffers for the cached plan (its views or a buffer changed)."""
        self.routes = {}
        self.group_tensors = {}
        self.batches = {}

    def route(
        self,
        copier: Copier,
        key: tuple[object, ...],
        sources: list[torch.Tensor],
        destinations: list[torch.Tensor],
        keep_sources: bool = False,
    ) -> CopyRoute | None:
        """The copier's route for ``key`` (made on first use from these sources and destinations)."""
        if key not in self.routes:
            self.routes[key] = copier.route(sources, destinations, keep_sources)
        return self.routes[key]

    def tensors(self) -> list[torch.Tensor]:
        return [self.buffer.tensor] + ([self.grad_buffer.tensor] if self.grad_buffer is not None else [])


def _touch_pages(buffer: SharedHostBuffer) -> None:
    # Fault every page into this process's page tables now, so the first copy into
    # the slot does not take ~one minor fault per 4 KiB inside a hook.
    flat = buffer.tensor
    if flat.numel():
        flat[:: 4096].zero_()


class SlotPool:
    """Host slots for in-flight snapshots, and their link to the writer's mappings."""

    def __init__(self, link: WriterLink, copier: Copier, max_inflight: int | None, distributed: bool = False) -> None:
        """``max_inflight``: the most slots; None sizes the pool at each ``preallocate`` (``auto_slot_count``)."""
        self.link = link
        link.on_replaced(self._hand_to)
        self.copier = copier
        # Page-locked for DMA (in the device's own context): only where the copier copies by DMA into it.
        self.pin: HostPinner | None = copier.device if copier.pins_host_memory else None
        self.sized_by_state = max_inflight is None
        self.distributed = distributed
        self.max_inflight = 1 if max_inflight is None else max_inflight
        self.slots: list[HostSlot] = []
        self._next_buffer_id = 0
        self._thread: threading.Thread | None = None
        self._prepared: list[tuple[SharedHostBuffer, SharedHostBuffer | None]] = []
        self._prepare_error: BaseException | None = None
        self.prepared_sizes: tuple[int, int] | None = None  # (slot bytes, gradient bytes) asked for
        self.landing: OwnedLandingPage | None = None  # made at the first pipelined snapshot (landing.py)

    # ---- allocation off the critical path ---------------------------------------

    def preallocate(self, slot_nbytes: int, grad_nbytes: int) -> None:
        """Start allocating every slot on a background thread (no-op if already done for these sizes)."""
        if self.prepared_sizes is not None and self.prepared_sizes[0] >= slot_nbytes and self.prepared_sizes[1] >= grad_nbytes:
            return
        self.finish_preallocation()
        self.prepared_sizes = (slot_nbytes, grad_nbytes)
        if self.sized_by_state:
            self.max_inflight = auto_slot_count(slot_nbytes, grad_nbytes, self.distributed)
        count = self.max_inflight - sum(1 for s in self.slots if s.busy)
        for slot in [s for s in self.slots if not s.busy]:
            self.release_slot(slot)
        self._thread = threading.Thread(
            target=self._allocate, args=(count, slot_nbytes, grad_nbytes), name="overlapckpt-preallocate"
        )
        self._thread.start()

    def _allocate(self, count: int, slot_nbytes: int, grad_nbytes: int) -> None:
        try:
            if self.copier.device is not None:
                # This thread's first runtime call (cudaHostRegister) must not go to GPU 0.
                self.copier.device.bind_thread()
            for _ in range(count):
                buffer = SharedHostBuffer(slot_nbytes, pin=self.pin)
                grad = SharedHostBuffer(grad_nbytes, pin=self.pin) if grad_nbytes else None
                self._prepared.append((buffer, grad))
                for b in (buffer, grad):
                    if b is not None:
                        _touch_pages(b)
        except BaseException as e:  # raised on the training thread by finish_preallocation
            self._prepare_error = e

    def preallocation_done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def finish_preallocation(self) -> None:
        """Join the allocating thread (blocking while it runs), announce its buffers, raise its error."""
        if self._thread is None:
            return
        self._thread.join(timeout=_PREALLOCATE_TIMEOUT_S)
        if self._thread.is_alive():
            raise OverlapCkptError(f"allocating host buffers did not finish within {_PREALLOCATE_TIMEOUT_S} s")
        self._thread = None
        prepared, self._prepared = self._prepared, []
        error, self._prepare_error = self._prepare_error, None
        try:
            while prepared:
                buffer, grad = prepared[0]
                slot = HostSlot(buffer_id=self._new_buffer_id(), buffer=buffer)
                self._announce(buffer, slot.buffer_id)
                self.slots.append(slot)
                prepared.pop(0)
                if grad is not None:
                    slot.grad_buffer, slot.grad_buffer_id = grad, self._new_buffer_id()
                    self._announce(grad, slot.grad_buffer_id)
        finally:
            for buffer, grad in prepared:  # the writer could not be told: nothing may stay in /dev/shm
                buffer.release()
                if grad is not None:
                    grad.release()
        if error is not None:
            raise error

    # ---- handing out slots ---------------------------------------------------------

    def may_have_free_slot(self) -> bool:
        return self._thread is not None or len(self.slots) < self.max_inflight or any(not s.busy for s in self.slots)

    def free_slot(self, slot_nbytes: int, grad_nbytes: int) -> HostSlot | None:
        """A free slot large enough, a new one within ``max_inflight``, or None if all are busy."""
        self.finish_preallocation()
        for slot in self.slots:
            if not slot.busy and slot.buffer.nbytes >= slot_nbytes:
                self._ensure_gradient_buffer(slot, grad_nbytes)
                return slot
        for slot in list(self.slots):  # a free slot too small for a grown state is replaced
            if not slot.busy:
                self.release_slot(slot)
        if len(self.slots) >= self.max_inflight:
            return None
        # The state grew past the preallocated size: the one allocation left inside a hook.
        slot = HostSlot(buffer_id=self._new_buffer_id(), buffer=SharedHostBuffer(slot_nbytes, pin=self.pin))
        self._announce(slot.buffer, slot.buffer_id)
        self.slots.append(slot)
        self._ensure_gradient_buffer(slot, grad_nbytes)
        return slot

    def _ensure_gradient_buffer(self, slot: HostSlot, grad_nbytes: int) -> None:
        if grad_nbytes == 0 or (slot.grad_buffer is not None and slot.grad_buffer.nbytes >= grad_nbytes):
            return
        self._release_gradient_buffer(slot)
        buffer = SharedHostBuffer(grad_nbytes, pin=self.pin)
        slot.grad_buffer, slot.grad_buffer_id = buffer, self._new_buffer_id()
        self._announce(buffer, slot.grad_buffer_id)

    def landing_page(self) -> OwnedLandingPage:
        """The landing page of pipelined snapshots, made and handed to the writer on first use."""
        if self.landing is None:
            page = OwnedLandingPage(self._new_buffer_id())
            self._announce(page.buffer, page.buffer_id)
            self.landing = page
        return self.landing

    def _hand_to(self, writer: WriterClient) -> None:
        """A new writer replaced a dead one: hand it every buffer (the memory itself never moved)."""
        if self.landing is not None:
            self._announce(self.landing.buffer, self.landing.buffer_id)
        for slot in self.slots:
            self._announce(slot.buffer, slot.buffer_id)
            if slot.grad_buffer is not None and slot.grad_buffer_id is not None:
                self._announce(slot.grad_buffer, slot.grad_buffer_id)

    def host_tensors(self) -> list[torch.Tensor]:
        """Every host buffer this pool holds (slots and gradient buffers)."""
        return [t for s in self.slots for t in s.tensors()]

    def host_nbytes(self) -> int:
        return sum(t.numel() for t in self.host_tensors())

    # ---- release ---------------------------------------------------------------------

    def drop(self, slot: HostSlot, tickets: list[CopyTicket]) -> None:
        """Free ``slot`` of a snapshot that will not be sent; its copies may still be queued."""
        slot.busy = False
        slot.pending = [t for t in slot.pending + tickets if not self.copier.poll(t)]

    def release_slot(self, slot: HostSlot) -> None:
        for ticket in slot.pending:
            # Rare (a dropped snapshot's slot regrown or torn down): the host waits for the
            # DMA into this memory before it is unregistered and unmapped.
            self.copier.wait(ticket)
        slot.pending = []
        self.slots.remove(slot)
        slot.views = []
        slot.forget_routes()
        self._release_gradient_buffer(slot)
        slot.buffer.release()
        self._tell_writer(p.ReleaseBufferRequest(slot.buffer_id))

    def release_all(self) -> None:
        """Release every buffer; the caller has made sure no copy still writes into them."""
        try:
            self.finish_preallocation()
        except BaseException:
            pass  # releasing: a failed allocation has nothing left to release
        for slot in list(self.slots):
            self.release_slot(slot)
        if self.landing is not None:
            self.landing.release()
            self._tell_writer(p.ReleaseBufferRequest(self.landing.buffer_id))
            self.landing = None

    def _release_gradient_buffer(self, slot: HostSlot) -> None:
        if slot.grad_buffer is None:
            return
        slot.forget_routes()  # some hold views of the gradient buffer
        slot.grad_buffer.release()
        slot.grad_buffer = None
        if slot.grad_buffer_id is not None:
            self._tell_writer(p.ReleaseBufferRequest(slot.grad_buffer_id))

    def _announce(self, buffer: SharedHostBuffer, buffer_id: int) -> None:
        """Ask the writer to map ``buffer``; release it here if the writer cannot be told."""
        try:
            self.link.writer.send_with_fd(p.MapBufferRequest(buffer_id, buffer.nbytes), buffer.fd)
        except BaseException:
            buffer.release()
            raise

    def _tell_writer(self, request: p.ReleaseBufferRequest) -> None:
        try:
            self.link.writer.send(request)
        except OverlapCkptError:
            pass  # a dead writer holds no mapping any more

    def _new_buffer_id(self) -> int:
        self._next_buffer_id += 1
        return self._next_buffer_id
