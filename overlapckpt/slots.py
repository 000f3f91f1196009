"""The pool of host slots: shared buffers allocated once, mapped by the writer, reused, released.

A slot holds one snapshot: the state's bytes, laid out by the plan, and in replay
mode the gradients its window logs. At most ``max_inflight`` slots exist; a request
that finds none free waits (the engine counts it as a deferral). Every buffer is
announced to the writer, which maps the same file; once the writer says it has
mapped a buffer the file name is unlinked, so nothing is left in ``/dev/shm`` if
either process dies.
"""

from __future__ import annotations

from . import protocol as p
from .errors import OverlapCkptError
from .gradlog import gradient_layout
from .hostbuf import SharedHostBuffer
from .plan import CopyPlan
from .snapshot import HostSlot
from .state import StateLayout
from .writer import WriterProcess


class SlotPool:
    """Host slots for in-flight snapshots, and their link to the writer's mappings."""

    def __init__(self, writer: WriterProcess, pin: bool, max_inflight: int) -> None:
        self.writer = writer
        self.pin = pin  # page-lock for DMA: only where a CUDA copier copies into it
        self.max_inflight = max_inflight
        self.slots: list[HostSlot] = []
        self._next_buffer_id = 0

    def may_have_free_slot(self) -> bool:
        return len(self.slots) < self.max_inflight or any(not s.busy for s in self.slots)

    def free_slot(self, plan: CopyPlan) -> HostSlot | None:
        """A free slot large enough for ``plan``, a new one within ``max_inflight``, or None."""
        for slot in self.slots:
            if not slot.busy and slot.buffer.nbytes >= plan.slot_nbytes:
                return slot
        for slot in list(self.slots):  # a free slot too small for a grown state is replaced
            if not slot.busy:
                self.release_slot(slot)
        if len(self.slots) >= self.max_inflight:
            return None
        slot = HostSlot(slot_id=self._new_buffer_id(), buffer=SharedHostBuffer(plan.slot_nbytes, pin=self.pin))
        self._announce(slot.buffer, slot.slot_id)
        self.slots.append(slot)
        return slot

    def prepare_gradient_views(self, slot: HostSlot, plan: CopyPlan, layout: StateLayout) -> None:
        """Replay: the slot's gradient buffer and views for this plan; grown when the window grew."""
        if slot.grad_plan_key == (plan.fingerprint, plan.window_steps):
            return
        offsets, nbytes = gradient_layout(plan, layout)
        if slot.grad_buffer is None or slot.grad_buffer.nbytes < nbytes:
            self._release_gradient_buffer(slot)
            buffer, buffer_id = SharedHostBuffer(nbytes, pin=self.pin), self._new_buffer_id()
            self._announce(buffer, buffer_id)
            slot.grad_buffer, slot.grad_buffer_id = buffer, buffer_id
        by_fqn = dict(zip(layout.param_fqns, layout.params))
        slot.grad_views = {
            key: slot.grad_buffer.view(off, by_fqn[key[1]].dtype, tuple(by_fqn[key[1]].shape))
            for key, off in offsets.items()
        }
        slot.grad_offsets = offsets
        slot.grad_plan_key = (plan.fingerprint, plan.window_steps)

    def mapped(self, buffer_id: int) -> None:
        """The writer mapped this buffer: both processes hold it, so its name can go."""
        for slot in self.slots:
            if slot.slot_id == buffer_id:
                slot.buffer.unlink()
            if slot.grad_buffer is not None and slot.grad_buffer_id == buffer_id:
                slot.grad_buffer.unlink()

    def host_nbytes(self) -> int:
        return sum(s.buffer.nbytes + (s.grad_buffer.nbytes if s.grad_buffer else 0) for s in self.slots)

    def release_slot(self, slot: HostSlot) -> None:
        self.slots.remove(slot)
        slot.views = []
        slot.staged_views = []
        slot.staging = None
        self._release_gradient_buffer(slot)
        slot.buffer.release()
        self._tell_writer(p.ReleaseSlotRequest(slot.slot_id))

    def release_all(self) -> None:
        for slot in list(self.slots):
            self.release_slot(slot)

    def _release_gradient_buffer(self, slot: HostSlot) -> None:
        if slot.grad_buffer is None:
            return
        slot.grad_views = {}
        slot.grad_plan_key = None
        slot.grad_buffer.release()
        slot.grad_buffer = None
        self._tell_writer(p.ReleaseSlotRequest(slot.grad_buffer_id))

    def _announce(self, buffer: SharedHostBuffer, buffer_id: int) -> None:
        """Ask the writer to map ``buffer``; release it here if the writer cannot be told."""
        try:
            self.writer.send(p.MapSlotRequest(buffer_id, buffer.path, buffer.nbytes))
        except BaseException:
            buffer.release()  # unpinned and unlinked: nothing is left in /dev/shm
            raise

    def _tell_writer(self, request: p.ReleaseSlotRequest) -> None:
        try:
            self.writer.send(request)
        except OverlapCkptError:
            pass  # a dead writer holds no mapping any more

    def _new_buffer_id(self) -> int:
        self._next_buffer_id += 1
        return self._next_buffer_id
