"""The plain CPU device: what CPU training runs the copier on.

On the CPU the "device" is host memory itself, so there is nothing to pin, nothing to
account and no allocator to model. What the copier still needs is a side stream: its
copies run on a worker thread (``worker_streams.py``), on a spare core, while the next
forward and backward run on the training thread, ordered by the same events and fences a
GPU's copies are (``benchmarks/copier_compare.py`` measures what that saves).

The tests' backend is ``emulated_device.py`` instead: the same streams, plus garbage in
fresh allocations, freed memory reused at once, an adversarial schedule and CUDA's error
codes, to make a missing fence fail on every run. None of that is wanted here: a queued
op holds the tensors it reads and writes, so their memory outlives it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from .device import TensorRun
from .worker_streams import WorkerStreams


class CpuDevice(WorkerStreams):
    """Worker-thread streams over host memory (see the module docstring); a ``StreamDevice`` (``device.py``)."""

    pins_host_memory = False  # host memory is what the copies read and write: nothing to page-lock
    clone_is_cheap = False  # a clone costs what a copy costs: replay copies the gradients, fenced
    host_is_the_device = True  # the training thread computes every value: a boundary's small tensors are read at the call
    packs_small_copies = False  # host to host, packing would copy the small tensors twice

    def __init__(self) -> None:
        super().__init__("async")

    def is_resident(self, t: torch.Tensor) -> bool:
        return True  # every tensor is copied through the side stream, off the training thread

    def bind_thread(self) -> None:
        return None

    def empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(max(nbytes, 0), dtype=torch.uint8)

    def copy_(self, destinations: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
        if not sources:
            return
        # The op holds the tensors themselves: their memory is not freed, nor reused, before it has run.
        # A route's TensorRun is never changed after it is made (device.py): held as it is; a plain
        # list, which its caller may edit, is copied.
        dsts, srcs = _held(destinations), _held(sources)

        def run() -> None:
            torch._foreach_copy_(dsts, srcs)

        self.current_stream().enqueue(run)

    def flatten(self, sources: Sequence[torch.Tensor], dtype: torch.dtype, numel: int) -> torch.Tensor:
        flat = torch.empty(numel, dtype=dtype)  # filled in the current stream's order, as on a GPU
        srcs = list(sources)

        def run() -> None:
            flat.copy_(torch._C._nn.flatten_dense_tensors(srcs))

        self.current_stream().enqueue(run)
        return flat

    def host_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def register_host(self, ptr: int, nbytes: int) -> int:
        return 0

    def unregister_host(self, ptr: int) -> int:
        return 0

    # Host memory is not a device's: the copies take none of their own to account.
    def memory_allocated(self) -> int:
        return 0

    def max_memory_allocated(self) -> int:
        return 0

    def reset_peak(self) -> None:
        return None

    def mem_get_info(self) -> tuple[int, int]:
        """(available, total) bytes of host memory: what stage mode's staging region may take.

        Linux's ``MemAvailable`` (free memory and the page cache it may reclaim), else the free pages.
        """
        page = os.sysconf("SC_PAGE_SIZE")
        total = os.sysconf("SC_PHYS_PAGES") * page
        try:
            with open("/proc/meminfo", "rb") as f:
                for line in f:
                    if line.startswith(b"MemAvailable:"):
                        return int(line.split()[1]) * 1024, total
        except OSError:
            pass
        return os.sysconf("SC_AVPHYS_PAGES") * page, total


def _held(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """What a queued op keeps of ``tensors``: a route's run itself, else a copy of the list."""
    return tensors if isinstance(tensors, TensorRun) else list(tensors)
