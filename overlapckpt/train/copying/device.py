"""The device seam: what the copier needs of a device, in one small protocol with two backends.

The copier (``stream_copier.py``) holds every decision: what is packed, what is cloned, which
stream waits for which event, how long a clone or a scratch buffer lives. A device only
does what it is told, the way CUDA does it:

* ``CudaDevice`` (``cuda_device.py``): torch's CUDA streams, events, caching allocator,
  ``cudaHostRegister``.
* ``EmulatedDevice`` (``emulated_device.py``): the same semantics on the CPU, wherever
  correctness depends on them: streams that run asynchronously on workers (and an
  adversarial schedule that runs a copy only when waited for), fresh allocations that
  hold garbage, freed memory handed to the next allocation on its stream at once,
  device memory accounted, host registration checked, and torch's placement rules for
  what lives on the host (Adam's ``step`` counter of a non-fused optimizer).

So the code a GPU runs is the code the CPU tests run; only these calls differ.

Vocabulary: the *training stream* is the stream the optimizer step was queued on (the
current stream in the hook); the *side stream* is the copier's own. An *event* marks a
point in a stream's queue; waiting on it from a stream is a device-side wait (the host
runs on), synchronizing on it blocks the host.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch


class StreamDevice(Protocol):
    """Streams, events, allocation, non-blocking copies, host registration and memory figures of one device."""

    # Host buffers must be page-locked (``register_host``) for this device's DMA to be asynchronous.
    pins_host_memory: bool
    # A clone on the training stream costs less than a fenced copy (HBM against PCIe).
    clone_is_cheap: bool
    # Small copies are gathered into one scratch span and sent in one transfer (packed_copy.py):
    # it saves a GPU's DMA launches; between host buffers it is a second memcpy for nothing.
    packs_small_copies: bool
    # The training stream is the host thread itself (the CPU): a small value is read at the call,
    # where a stream would queue it behind the copies already on the side stream.
    host_is_the_device: bool

    def is_resident(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lives in device memory (copied through a stream), not in host memory."""
        ...

    def bind_thread(self) -> None:
        """Make this device current on the calling thread, before it makes any runtime call."""
        ...

    def new_stream(self) -> Any: ...

    def current_stream(self) -> Any: ...

    def stream_context(self, stream: Any) -> AbstractContextManager[Any]:
        """Within it, allocations and copies are queued on ``stream``."""
        ...

    def record_event(self, stream: Any) -> Any: ...

    def wait_event(self, stream: Any, event: Any) -> None:
        """``stream`` runs nothing queued after this call before ``event`` (a device-side wait)."""
        ...

    def wait_stream(self, waiter: Any, waitee: Any) -> None:
        """``waiter`` runs nothing queued after this call before everything queued on ``waitee`` so far."""
        ...

    def event_done(self, event: Any) -> bool:
        """Whether everything before ``event`` has run (never blocks; raises a failed copy's error)."""
        ...

    def synchronize_event(self, event: Any) -> None:
        """Block the host until ``event`` (never from a hook)."""
        ...

    def await_event(self, event: Any, timeout_s: float) -> bool:
        """Block the calling thread, never the training loop's, until ``event`` is done or ``timeout_s`` passed.

        Whether it is done. Unlike ``synchronize_event`` it hurries nothing queued on the
        device: a thread that watches copies land must not change when they land.
        """
        ...

    def synchronize_stream(self, stream: Any) -> None: ...

    def elapsed_s(self, start: Any, end: Any) -> float: ...

    def empty(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of device memory (uint8), allocated on the current stream."""
        ...

    def copy_(self, destinations: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
        """Queue non-blocking copies on the current stream."""
        ...

    def flatten(self, sources: Sequence[torch.Tensor], dtype: torch.dtype, numel: int) -> torch.Tensor:
        """A fresh 1-D device tensor of ``numel`` elements: the sources (all of ``dtype``, device
        memory) one after another, queued on the current stream in one call, with no per-tensor
        Python (a packed clone of thousands of gradients)."""
        ...

    def host_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A small host tensor a device-to-host copy may target without a host sync (pinned on CUDA)."""
        ...

    def register_host(self, ptr: int, nbytes: int) -> int:
        """Page-lock host memory for DMA; the runtime's error code (0: done)."""
        ...

    def unregister_host(self, ptr: int) -> int: ...

    def memory_allocated(self) -> int: ...

    def max_memory_allocated(self) -> int: ...

    def reset_peak(self) -> None:
        """Start ``max_memory_allocated`` again from what is allocated now."""
        ...

    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) bytes of device memory that a new allocation can get without freeing the allocator's cache."""
        ...

    def close(self) -> None: ...


class TensorRun(list[torch.Tensor]):
    """Tensors that a copy route passes to ``copy_`` on every copy, never changed after it is made.

    Hashed and compared by identity, so a device may keep work derived from a run (the
    emulated device keeps its device views and host ranges) for exactly as long as the
    run lives, in a ``WeakKeyDictionary``. A plain list gets no such cache: its caller may
    edit it between copies.
    """

    __hash__ = object.__hash__  # type: ignore[assignment]

    def __eq__(self, other: object) -> bool:
        return self is other


def align_up(nbytes: int, alignment: int) -> int:
    """``nbytes`` rounded up to a multiple of ``alignment``."""
    return (nbytes + alignment - 1) // alignment * alignment
