"""A CUDA device emulated on the CPU: the copier's adversarial backend in the tests (CPU training runs ``cpu_device.py``).

It behaves as CUDA does wherever the correctness of a checkpoint depends on it:

* **Streams** are ``worker_streams.py``'s: worker threads with CUDA's stream and event
  semantics. ``"held"``, the adversarial schedule, runs an op only once something waits
  for an event after it, so a missing fence lets the mutation it guards run first on
  every run.
* **Allocation** follows the caching allocator. A fresh block holds garbage (the poison
  byte), never zeros. A block is freed when the last tensor on it dies (a weakref on its
  storage), goes back at once to the cache of the stream it was allocated on, and is
  poisoned in that stream's order: on the host's stream at once, on a side stream after
  the work queued there. So memory released before a copy on another stream read it is
  overwritten on every run. Queued copies hold the block's memory, never a reference
  to the tensor, as a DMA holds an address.
* **Memory** is accounted (allocated, peak, reserved, ``mem_get_info`` against a
  capacity); an allocation that does not fit frees the cache and retries (counted in
  ``free_and_retry``: a device synchronization on CUDA), then raises ``OutOfMemoryError``.
* **Placement.** ``host_resident`` says which tensors CUDA would keep on the host (see
  ``torch_cuda_placement``); every other tensor is device memory.
* **The runtime.** Host registration is checked like ``cudaHostRegister`` (an overlapping
  range is error 712, an unknown one 713), unregistering memory a queued copy still
  writes is recorded in ``faults`` (a DMA into unmapped memory), runtime calls record the
  calling thread's current device in ``contexts``, and ``sync_debug_error`` makes host
  synchronizations raise, as ``torch.cuda.set_sync_debug_mode("error")`` does.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .device import TensorRun, align_up
from .worker_streams import WorkerStream, WorkerStreams

POISON_BYTE = 0xA5  # fp32 0xA5A5A5A5 is -2.9e-16: garbage that looks like a number, as on a GPU
_BLOCK_ROUND_BYTES = 512  # the caching allocator's size granularity
# CUDA runtime error codes the emulated registration returns.
ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712
ERROR_HOST_MEMORY_NOT_REGISTERED = 713


@dataclass(eq=False)  # compared by identity: removing one from a cache list must not compare tensors
class _Block:
    backing: torch.Tensor  # the memory itself: the allocator holds it for the device's life
    stream: WorkerStream
    nbytes: int


class EmulatedDevice(WorkerStreams):
    """The emulated CUDA device (see the module docstring)."""

    pins_host_memory = True
    host_is_the_device = False  # CUDA's model: a device value is read through the side stream
    packs_small_copies = True  # as CUDA does: the tests run the packed route's fences
    locks_pages = False  # registration is checked and recorded; no page is locked

    def __init__(
        self,
        schedule: str = "async",
        *,
        clone_is_cheap: bool = False,
        host_resident: Callable[[torch.Tensor], bool] | None = None,
        capacity_bytes: int = 1 << 40,
        index: int = 0,
    ) -> None:
        super().__init__(schedule)
        # Replay's gradient strategy (see GradientLogger): the CPU tests run both.
        self.clone_is_cheap = clone_is_cheap
        self.host_resident = host_resident
        self.capacity_bytes = capacity_bytes
        self.index = index
        # Device views (and host ranges) of the TensorRuns that copy routes pass, for as long as each run lives.
        self._runs: weakref.WeakKeyDictionary[TensorRun, tuple[list[torch.Tensor], tuple[tuple[int, int], ...] | None]] = (
            weakref.WeakKeyDictionary()
        )
        self._lock = threading.RLock()  # storage finalizers may run on any thread, inside our own calls
        self._live: dict[int, _Block] = {}  # handed-out storage address -> its block
        self._cache: dict[int, list[_Block]] = {}  # id(stream) -> free blocks
        self.allocated_bytes = 0
        self.peak_bytes = 0
        self.reserved_bytes = 0
        self.allocations: list[int] = []  # every allocation's size, in order (tests read it)
        self.free_and_retry = 0
        self.registered: dict[int, int] = {}  # host address -> bytes
        self.faults: list[str] = []
        self.contexts: set[int] = set()
        self.sync_debug_error = False

    # ---- placement and threads ------------------------------------------------------

    def is_resident(self, t: torch.Tensor) -> bool:
        return self.host_resident is None or not self.host_resident(t)

    def bind_thread(self) -> None:
        self._local.device_index = self.index

    def _runtime_call(self) -> None:
        # CUDA creates a context on the calling thread's current device at its first runtime call.
        self.contexts.add(getattr(self._local, "device_index", 0))

    def _host_sync(self, what: str) -> None:
        if self.sync_debug_error:
            raise RuntimeError(f"called a synchronizing CUDA operation (emulated device: {what})")

    # ---- allocation -------------------------------------------------------------------

    def empty(self, nbytes: int) -> torch.Tensor:
        if nbytes <= 0:
            return torch.empty(0, dtype=torch.uint8)
        stream = self.current_stream()
        size = align_up(nbytes, _BLOCK_ROUND_BYTES)
        with self._lock:
            self._runtime_call()
            block = self._take_cached(stream, size)
            if block is None:
                block = self._new_block(stream, size)
            self.allocated_bytes += block.nbytes
            self.peak_bytes = max(self.peak_bytes, self.allocated_bytes)
            self.allocations.append(nbytes)
            flat: Any = block.backing.numpy()
            handed = torch.frombuffer(memoryview(flat)[:nbytes], dtype=torch.uint8)
            self._live[handed.data_ptr()] = block
        weakref.finalize(handed.untyped_storage(), self._freed, handed.data_ptr())
        return handed

    def _take_cached(self, stream: WorkerStream, size: int) -> _Block | None:
        free = self._cache.get(id(stream), [])
        fits = [b for b in free if b.nbytes >= size]
        if not fits:
            return None
        block = min(fits, key=lambda b: b.nbytes)
        free.remove(block)
        return block

    def _new_block(self, stream: WorkerStream, size: int) -> _Block:
        if self.reserved_bytes + size > self.capacity_bytes:
            # The caching allocator frees its cached blocks and retries: on CUDA a device synchronization.
            self.free_and_retry += 1
            self._host_sync("free the allocator's cache and retry an allocation")
            for free in self._cache.values():
                self.reserved_bytes -= sum(b.nbytes for b in free)
                free.clear()
            if self.reserved_bytes + size > self.capacity_bytes:
                raise torch.OutOfMemoryError(
                    f"emulated device: tried to allocate {size} bytes with {self.capacity_bytes - self.reserved_bytes} "
                    f"of {self.capacity_bytes} free"
                )
        backing = torch.empty(size, dtype=torch.uint8)
        backing.fill_(POISON_BYTE)
        self.reserved_bytes += size
        return _Block(backing, stream, size)

    def _freed(self, address: int) -> None:
        with self._lock:
            block = self._live.pop(address, None)
            if block is None:
                return
            self.allocated_bytes -= block.nbytes
            # Back in its stream's cache at once, poisoned in that stream's order: work queued
            # there earlier still sees the old bytes, a reader on another stream does not.
            self._cache.setdefault(id(block.stream), []).append(block)
        block.stream.enqueue(lambda: block.backing.fill_(POISON_BYTE))

    def _device_view(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` seen over its block's memory: what a queued copy holds instead of the tensor."""
        if t.numel() == 0:
            # An empty tensor has no bytes to copy, and torch gives it data_ptr() 0 even as a view
            # into a block: an offset from the block's start would be negative (an empty buffer such
            # as a model's `register_buffer("marker", torch.empty(0))` crashed the first checkpoint).
            return t.detach()
        with self._lock:
            block = self._live.get(t.untyped_storage().data_ptr())
        if block is None:
            return t.detach()
        offset = t.data_ptr() - block.backing.data_ptr()
        view = torch.empty(0, dtype=t.dtype)
        view.set_(block.backing.untyped_storage(), offset // t.element_size(), t.size(), t.stride())
        return view

    def _device_views(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``_device_view`` of each; the blocks are looked up in C, as most tensors are in none (host memory, gradients)."""
        storages = list(map(torch.UntypedStorage.data_ptr, map(torch.Tensor.untyped_storage, tensors)))
        with self._lock:
            blocks = list(map(self._live.get, storages))
        if not any(blocks):
            return list(tensors)  # read under no_grad on the stream (copy_): nothing to detach
        return [t if b is None else self._device_view(t) for t, b in zip(tensors, blocks)]

    def copy_(self, destinations: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
        if not sources:
            return
        dsts, host_ranges = self._run_views(destinations, with_host_ranges=True)
        srcs, _ = self._run_views(sources, with_host_ranges=False)

        def run() -> None:
            with torch.no_grad():  # a stream's worker thread starts with autograd on: a copy records nothing
                torch._foreach_copy_(dsts, srcs)

        self.current_stream().enqueue(run, host_ranges)

    def flatten(self, sources: Sequence[torch.Tensor], dtype: torch.dtype, numel: int) -> torch.Tensor:
        # A fresh block (garbage until the op runs), filled in the current stream's order.
        flat = self.empty(numel * torch.empty((), dtype=dtype).element_size()).view(dtype)
        srcs = self._device_views(sources)
        dst = self._device_view(flat)

        def run() -> None:
            with torch.no_grad():  # in C++, as CUDA's cat: no Python object per source
                dst.copy_(torch._C._nn.flatten_dense_tensors(srcs))

        self.current_stream().enqueue(run)
        return flat

    def _run_views(
        self, tensors: Sequence[torch.Tensor], with_host_ranges: bool
    ) -> tuple[list[torch.Tensor], tuple[tuple[int, int], ...]]:
        """Device views of ``tensors`` and the host ranges among them; kept while a ``TensorRun`` lives.

        A run's tensors are held by the run, so their blocks stay theirs: the views (the
        per-tensor work here, as a CUDA launch's set-up is on the GPU) are made once.
        """
        cached = self._runs.get(tensors) if isinstance(tensors, TensorRun) else None
        if cached is not None and (cached[1] is not None or not with_host_ranges):
            return cached[0], cached[1] or ()
        views = cached[0] if cached is not None else self._device_views(tensors)
        host_ranges: tuple[tuple[int, int], ...] | None = None
        if with_host_ranges:
            with self._lock:
                device_addresses = {b.backing.data_ptr() for b in self._live.values()}
            host_ranges = tuple(
                (v.data_ptr(), v.numel() * v.element_size())
                for v, t in zip(views, tensors)
                if t.untyped_storage().data_ptr() not in device_addresses
            )
        if isinstance(tensors, TensorRun):
            self._runs[tensors] = (views, host_ranges)
        return views, host_ranges or ()

    def host_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    # ---- host registration ----------------------------------------------------------------

    def register_host(self, ptr: int, nbytes: int) -> int:
        self._runtime_call()
        with self._lock:
            if any(ptr < a + n and a < ptr + nbytes for a, n in self.registered.items()):
                return ERROR_HOST_MEMORY_ALREADY_REGISTERED
            self.registered[ptr] = nbytes
        return 0

    def unregister_host(self, ptr: int) -> int:
        self._runtime_call()
        with self._lock:
            nbytes = self.registered.pop(ptr, None)
        if nbytes is None:
            return ERROR_HOST_MEMORY_NOT_REGISTERED
        for stream in self._streams:
            for a, n in stream.pending_host_ranges():
                if a < ptr + nbytes and ptr < a + n:
                    self.faults.append(
                        f"host memory at {ptr:#x} ({nbytes} bytes) unregistered while a copy queued on "
                        f"{stream.name} still writes {n} bytes at {a:#x}"
                    )
        return 0

    # ---- memory figures --------------------------------------------------------------------

    def memory_allocated(self) -> int:
        return self.allocated_bytes

    def max_memory_allocated(self) -> int:
        return self.peak_bytes

    def reset_peak(self) -> None:
        self.peak_bytes = self.allocated_bytes

    def mem_get_info(self) -> tuple[int, int]:
        return self.capacity_bytes - self.reserved_bytes, self.capacity_bytes

def torch_cuda_placement(optimizer: torch.optim.Optimizer, host_tensors: Sequence[torch.Tensor] = ()) -> Callable[[torch.Tensor], bool]:
    """Where torch keeps a tensor on CUDA: True for what stays in host memory.

    torch.optim keeps the ``step`` counter of Adam, AdamW, Adamax, NAdam, RAdam, ASGD and
    Adagrad on the host unless the group is ``fused`` or ``capturable`` (read in
    torch/optim/*.py: ``torch.tensor(0.0, dtype=_get_scalar_dtype())`` on the CPU there);
    ``host_tensors`` are others the user put on the host (a tensor lr). Everything else
    of the model and optimizer is device memory.
    """
    from ...optimizers import OptimizerGroup

    host_addresses = {t.data_ptr() for t in host_tensors}
    optimizers = optimizer.optimizers if isinstance(optimizer, OptimizerGroup) else (optimizer,)
    gathered: dict[str, Any] = {"signature": None, "addresses": set()}

    def step_addresses() -> set[int]:
        # Asked per tensor while routes are made (tens of thousands): the step counters' addresses
        # are gathered again only when an optimizer's state mapping was replaced or gained entries.
        signature = tuple((id(opt.state), len(opt.state), len(opt.param_groups)) for opt in optimizers)
        if signature != gathered["signature"]:
            found = set()
            for opt in optimizers:
                for group in opt.param_groups:
                    if group.get("fused") or group.get("capturable"):
                        continue
                    for p in group["params"]:
                        step = opt.state[p].get("step") if p in opt.state else None
                        if isinstance(step, torch.Tensor):
                            found.add(step.data_ptr())
            gathered["signature"], gathered["addresses"] = signature, found
        return gathered["addresses"]

    def host_resident(t: torch.Tensor) -> bool:
        ptr = t.data_ptr()
        return ptr in host_addresses or ptr in step_addresses()

    return host_resident
