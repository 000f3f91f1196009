"""The CUDA backend of the device seam (``device.py``): torch's streams, events and caching allocator.

Every call is a thin wrapper; what is copied, when and behind which fence is decided by
the copier, whose logic the CPU tests run on the emulated device. Lines here that no CPU
test reaches are listed in docs/gpu.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch


class CudaDevice:
    """One CUDA device, as the copier uses it."""

    pins_host_memory = True
    clone_is_cheap = True
    host_is_the_device = False
    packs_small_copies = True  # one DMA for many small tensors
    locks_pages = True  # register_host page-locks for real (the emulated device only keeps the books)

    def __init__(self, device: torch.device) -> None:
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)

    def is_resident(self, t: torch.Tensor) -> bool:
        return t.device.type == "cuda"

    def bind_thread(self) -> None:
        # A new thread's current device is 0: a runtime call made there before this would
        # create a context on GPU 0 (about 500 MB) for every rank of the node.
        torch.cuda.set_device(self.device)

    def new_stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream(device=self.device)

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def stream_context(self, stream: Any) -> AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def record_event(self, stream: Any) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def wait_event(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def wait_stream(self, waiter: Any, waitee: Any) -> None:
        waiter.wait_stream(waitee)

    def event_done(self, event: Any) -> bool:
        return bool(event.query())

    def synchronize_event(self, event: Any) -> None:
        event.synchronize()

    def await_event(self, event: Any, timeout_s: float) -> bool:
        # cudaEventSynchronize has no timeout: it returns once the copy engine has run the copies
        # recorded before the event (a bounded wait, with the GIL released), and queues nothing.
        event.synchronize()
        return True

    def synchronize_stream(self, stream: Any) -> None:
        stream.synchronize()

    def elapsed_s(self, start: Any, end: Any) -> float:
        return float(start.elapsed_time(end)) / 1000.0

    def empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def copy_(self, destinations: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
        # No autograd: a source may be a parameter (a copy route passes them undetached), and
        # a recorded copy would tie the destination to the parameter's graph.
        with torch.no_grad():
            # One call for any mix, with no Python per pair: pairs on one device take the grouped
            # kernel (a route's gather), the others torch's per-pair copy_, non-blocking into
            # pinned host memory (an asynchronous DMA; non_blocking=False would sync the host).
            torch._foreach_copy_(list(destinations), list(sources), non_blocking=True)

    def flatten(self, sources: Sequence[torch.Tensor], dtype: torch.dtype, numel: int) -> torch.Tensor:
        with torch.no_grad():
            # One cat on the current stream, allocated there by the caching allocator.
            flat = torch._C._nn.flatten_dense_tensors(list(sources))
            # Of one tensor torch returns a view of it, not a copy: the caller needs a copy.
            return flat.clone() if len(sources) == 1 and flat.data_ptr() == sources[0].data_ptr() else flat

    def host_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def register_host(self, ptr: int, nbytes: int) -> int:
        with torch.cuda.device(self.device):
            return int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0))

    def unregister_host(self, ptr: int) -> int:
        with torch.cuda.device(self.device):
            return int(torch.cuda.cudart().cudaHostUnregister(ptr))

    def memory_allocated(self) -> int:
        return int(torch.cuda.memory_allocated(self.device))

    def max_memory_allocated(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.device))

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def mem_get_info(self) -> tuple[int, int]:
        free_bytes, total_bytes = torch.cuda.mem_get_info(self.device)
        return int(free_bytes), int(total_bytes)

    def close(self) -> None:
        return None
