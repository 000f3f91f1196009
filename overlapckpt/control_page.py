"""A page of shared memory between a training process and its writer: preemption agreed with no collective in a hook.

Shared by both sides (``train/run/preemption.py`` writes and reads it at iteration
boundaries, ``writer/preempt_watch.py`` from a thread of the writer). Each slot is one
aligned 64-bit word, so a read or a write of it is a single machine access: no lock,
and a hook pays a few hundred nanoseconds for it.

The slots, and who writes them:

- ``STEP`` (trainer, every boundary): the last iteration boundary it passed;
- ``SIGNAL`` (trainer, its signal handler): the signal this rank received, 0 if none;
- ``HOLD`` (writer): a preemption is under way; the trainer must not pass its next
  boundary until ``AGREED`` is set;
- ``AGREED`` (writer): the step at which every rank checkpoints and exits; 0 while
  unknown, ``NO_AGREEMENT`` if the ranks could not agree in time;
- ``AGREED_SIGNAL`` (writer): the signal every rank exits with;
- ``FORGED`` (writer): how many values in the store's preemption keys it refused as
  not written by this run's writers (``writer/sealed_store.py``), for the log and tests.
"""

from __future__ import annotations

import ctypes

from .hostbuf import SharedHostBuffer

STEP, SIGNAL, HOLD, AGREED, AGREED_SIGNAL, FORGED = range(6)
SLOTS = 8
NOT_YET = 0
NO_AGREEMENT = -1
PAGE_BYTES = 4096


class ControlPage:
    """The words of one control page, over a shared mapping (the caller keeps the mapping alive)."""

    def __init__(self, address: int) -> None:
        self._words = (ctypes.c_int64 * SLOTS).from_address(address)

    def read(self, slot: int) -> int:
        return int(self._words[slot])

    def write(self, slot: int, value: int) -> None:
        self._words[slot] = value


class OwnedControlPage(ControlPage):
    """The training process's page: its shared memory, whose descriptor goes to the writer."""

    def __init__(self) -> None:
        self.buffer = SharedHostBuffer(PAGE_BYTES, pin=None)
        self.buffer.tensor.zero_()
        super().__init__(self.buffer.tensor.data_ptr())

    @property
    def fd(self) -> int:
        return self.buffer.fd
