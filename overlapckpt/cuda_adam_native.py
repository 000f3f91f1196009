"""The optional native helper for replay's CUDA arithmetic (``csrc/cuda_adam.c``): one pass per tensor, fused or foreach.

``fused_adam_math.py`` computes CUDA's fused Adam/AdamW roundings with torch operations, about
twenty passes over each tensor (about 20 ns per element on one thread, against 0.7 ns for
the CPU's own fused kernel). This C loop does it in one vectorized pass (about 0.8 ns), for contiguous float32
tensors (``benchmarks/results/replay-arithmetic/run3.txt``); ``foreach_adam_math.py``'s kernels likewise.
A large tensor is split across the writer's threads (``torch.get_num_threads()``, which the
writer sets to ``writer_threads``): elementwise, so the same bits as one call. Replay steps
each tensor several times: inside :func:`steps_deferred` the steps wait and run in one pass over
the tensor, each block of it carried through every step while it is in cache, so param and
moments cross memory once instead of once a step.
The tests hold both roads to the same exact reference. Compiled once per source version into the user's cache (``cbuild.py``) by
``cc -O3 -fno-math-errno -fno-trapping-math -ffp-contract=off``: where no compiler exists, or
``OVERLAPCKPT_NATIVE=0``, the torch road runs. Used by the writer; imports neither side.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from .adam_step_arguments import ForeachAdamScalars, FusedAdamScalars
from .cbuild import NativeLibrary, build_c_library, c_library_path

SOURCE = Path(__file__).resolve().parent / "csrc" / "cuda_adam.c"


# -ffp-contract=off: no FMA the kernel does not write; -fno-math-errno and -fno-trapping-math change
# no result (they let -O3 vectorize sqrt and the selects). All are in the library's name
# (cbuild.py): one built otherwise is never reused.
FLAGS = ["-O3", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off"]
LIBRARIES = ["-lm"]


def library_path() -> Path | None:
    """Where the built library for this source, compiler and flags lives (None without the source: an installed wheel)."""
    return c_library_path(SOURCE, "cuda_adam", FLAGS, LIBRARIES)


def build(quiet: bool = True) -> Path | None:
    """Compile the library if it is not built yet (a fraction of a second); its path, or None where it cannot be."""
    return build_c_library(SOURCE, "cuda_adam", FLAGS, LIBRARIES, "replay's CUDA arithmetic runs through torch", quiet)


# CDLL: the call releases the GIL; it runs for milliseconds on large tensors, and the writer's
# other threads (storage, the training side's requests) go on meanwhile.
_cuda_adam = NativeLibrary(
    library_path, build, ctypes.CDLL,
    {
        "overlapckpt_cuda_fused_adam_f32": [ctypes.c_void_p] * 5 + [ctypes.c_int64] + [ctypes.c_float] * 7 + [ctypes.c_int] * 3,
        "overlapckpt_cuda_foreach_adam_f32": [ctypes.c_void_p] * 5 + [ctypes.c_int64] + [ctypes.c_float] * 8 + [ctypes.c_int] * 3,
        # param, the steps' gradient addresses, exp_avg, exp_avg_sq, max_exp_avg_sq; count, steps; scalars, flags
        "overlapckpt_cuda_fused_adam_f32_steps": [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 2 + [ctypes.c_void_p] * 2,
        "overlapckpt_cuda_foreach_adam_f32_steps": [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 2 + [ctypes.c_void_p] * 2,
    },
    "replay's CUDA arithmetic runs through torch",
)


def library() -> ctypes.CDLL | None:
    """The loaded library (built on first use), or None: disabled, no compiler, or no source."""
    return _cuda_adam.get()


# Below this many elements a tensor is one call: splitting it costs more than it saves.
PARALLEL_MIN_ELEMENTS = 1 << 18
_CHUNK_ALIGN = 64  # elements: each thread's chunk starts on a cache line of every array
_pools: dict[int, concurrent.futures.ThreadPoolExecutor] = {}  # by thread count: the writer sets one and keeps it
_pools_lock = threading.Lock()


def _threads() -> int:
    """The threads a pass may use: torch's intra-op count, which the writer sets to its own (``writer_threads``)."""
    return max(1, torch.get_num_threads())


def _executor(threads: int) -> concurrent.futures.ThreadPoolExecutor:
    with _pools_lock:
        if threads not in _pools:
            _pools[threads] = concurrent.futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="overlapckpt-replay")
        return _pools[threads]


def _chunks(count: int) -> list[tuple[int, int]]:
    """(first element, elements) of each thread's part of a tensor of ``count`` elements: one part where small."""
    threads = _threads()
    if threads == 1 or count < PARALLEL_MIN_ELEMENTS:
        return [(0, count)]
    per_thread = -(-count // threads)
    per_thread = -(-per_thread // _CHUNK_ALIGN) * _CHUNK_ALIGN
    return [(begin, min(per_thread, count - begin)) for begin in range(0, count, per_thread)]


def _run_chunks(calls: Sequence[Callable[[], Any]]) -> None:
    """Each call on the writer's threads (one call runs here). The update is elementwise, so the chunks are
    independent and the result is the same bits as one call; each call releases the GIL (ctypes.CDLL)."""
    if len(calls) == 1:
        calls[0]()
        return
    futures = [_executor(len(calls)).submit(call) for call in calls]
    for future in futures:
        future.result()  # every chunk done (and any error raised) before the tensors are read


def _addresses_at(tensors: list[torch.Tensor], has_max: bool, begin: int) -> list[int | None]:
    """param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq (None without amsgrad) at element ``begin`` (float32: 4 bytes each)."""
    return [t.data_ptr() + 4 * begin for t in tensors[:4]] + [tensors[4].data_ptr() + 4 * begin if has_max else None]


def _in_parallel(function: Any, tensors: list[torch.Tensor], has_max: bool, scalars: tuple[Any, ...]) -> None:
    """``function(pointers..., count, *scalars)`` over the tensors, split across the writer's threads where large."""
    calls = [
        functools.partial(function, *_addresses_at(tensors, has_max, begin), n, *scalars) for begin, n in _chunks(tensors[0].numel())
    ]
    _run_chunks(calls)


# How many of a single-step call's scalars are floats; the rest (3) are int flags.
_FLOATS = {"fused": 7, "foreach": 8}
_STEP_FLAGS = 3


class _QueuedSteps:
    """Every tensor's updates queued inside :func:`steps_deferred`, by tensor, in the order they were asked for."""

    def __init__(self) -> None:
        # (kind, param, exp_avg, exp_avg_sq, max_exp_avg_sq addresses, elements) -> [(tensors, has_max, scalars)]
        self.by_tensor: dict[tuple[Any, ...], list[tuple[list[torch.Tensor], bool, tuple[Any, ...]]]] = {}

    def add(self, kind: str, tensors: list[torch.Tensor], has_max: bool, scalars: tuple[Any, ...]) -> None:
        param, _, exp_avg, exp_avg_sq = tensors[:4]  # the gradient (second) differs from step to step
        key = (kind, param.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(), tensors[4].data_ptr() if has_max else 0, param.numel())
        self.by_tensor.setdefault(key, []).append((tensors, has_max, scalars))  # the tensors held: the gradients stay mapped

    def run(self, lib: ctypes.CDLL) -> None:
        for (kind, *_), queued in self.by_tensor.items():
            if len(queued) == 1:
                tensors, has_max, scalars = queued[0]
                _in_parallel(getattr(lib, f"overlapckpt_cuda_{kind}_adam_f32"), tensors, has_max, scalars)
            else:
                _steps_in_parallel(getattr(lib, f"overlapckpt_cuda_{kind}_adam_f32_steps"), _FLOATS[kind], queued)


def _steps_in_parallel(function: Any, floats: int, queued: list[tuple[list[torch.Tensor], bool, tuple[Any, ...]]]) -> None:
    """One tensor's queued steps in one blocked pass per thread's part (``csrc/cuda_adam.c``'s ``_steps`` functions)."""
    tensors, has_max, _ = queued[0]
    steps = len(queued)
    scalars = (ctypes.c_float * (steps * floats))(*(x for _, _, s in queued for x in s[:floats]))
    flags = (ctypes.c_int32 * (steps * _STEP_FLAGS))(*(int(x) for _, _, s in queued for x in s[floats:]))
    gradients = [held[1].data_ptr() for held, _, _ in queued]
    calls = []
    for begin, n in _chunks(tensors[0].numel()):
        p, _, m, v, mx = _addresses_at(tensors, has_max, begin)  # the one gradient's address: each step's is below
        step_gradients = (ctypes.c_int64 * steps)(*(g + 4 * begin for g in gradients))  # held by the call until it runs
        calls.append(functools.partial(function, p, step_gradients, m, v, mx, n, steps, scalars, flags))
    _run_chunks(calls)


_deferred = threading.local()


@contextlib.contextmanager
def steps_deferred() -> Iterator[None]:
    """Inside it, each tensor's updates through the library wait, and run when the block ends: all of one tensor's
    steps in one pass over it, each element carried through them in cache (the same bits as one call a step).

    For replay (``writer/replay.py``), where nothing reads a stepped tensor between its steps. Where
    the block raises, the queued updates are dropped: the tensors are as before it.
    """
    queue, previous = _QueuedSteps(), getattr(_deferred, "queue", None)
    _deferred.queue = queue
    try:
        yield
    finally:
        _deferred.queue = previous
    lib = library()
    if lib is not None and queue.by_tensor:
        queue.run(lib)


def _call_or_queue(lib: ctypes.CDLL, kind: str, tensors: list[torch.Tensor], has_max: bool, scalars: tuple[Any, ...]) -> None:
    queue: _QueuedSteps | None = getattr(_deferred, "queue", None)
    if queue is not None:
        queue.add(kind, tensors, has_max, scalars)
    else:
        _in_parallel(getattr(lib, f"overlapckpt_cuda_{kind}_adam_f32"), tensors, has_max, scalars)


def _takes(tensors: list[torch.Tensor]) -> ctypes.CDLL | None:
    """The library, where every tensor is contiguous float32 on the CPU; else None (the torch road runs)."""
    lib = library()
    if lib is None or any(t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu" for t in tensors):
        return None
    return lib


def fused_step_float32(tensors: list[torch.Tensor], has_max: bool, scalars: FusedAdamScalars) -> bool:
    """One tensor's update in place through the library: param, grad, exp_avg, exp_avg_sq (, max_exp_avg_sq).

    Every scalar is a float32 value already (the kernel's). False, with nothing written, where the
    library is not loaded or a tensor is not contiguous float32 on the CPU: the torch road then runs.
    """
    lib = _takes(tensors)
    if lib is None:
        return False
    _call_or_queue(lib, "fused", tensors, has_max, (
        scalars.lr_times_weight_decay, scalars.beta1, scalars.beta2, scalars.weight_decay, scalars.eps, scalars.step_size,
        scalars.bias_correction2_sqrt, int(scalars.decoupled_weight_decay), int(scalars.l2_contracted), int(scalars.maximize),
    ))
    return True


def foreach_step_float32(tensors: list[torch.Tensor], has_max: bool, scalars: ForeachAdamScalars) -> bool:
    """One tensor's foreach update in place through the library, as :func:`fused_step_float32` (False: the torch road runs).

    The scalars are the kernels' float32 values: ``decay`` is ``1 - lr * weight_decay``, ``lerp_weight``
    ``1 - beta1``, ``step_size`` ``-lr / bias_correction1``, each cast once from the host's double
    (``capturable``: the device's own float32 step size, and the capturable path's update).
    """
    lib = _takes(tensors)
    if lib is None:
        return False
    _call_or_queue(lib, "foreach", tensors, has_max, (
        scalars.weight_decay, scalars.decay, scalars.lerp_weight, scalars.beta2, scalars.one_minus_beta2, scalars.eps,
        scalars.step_size, scalars.bias_correction2_sqrt, int(scalars.decoupled_weight_decay), int(scalars.maximize),
        int(scalars.capturable),
    ))
    return True
