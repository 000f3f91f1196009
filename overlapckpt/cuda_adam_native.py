"""The optional native helper for replay's CUDA arithmetic (``csrc/cuda_adam.c``): one pass per tensor, fused or foreach.

``fused_adam_math.py`` computes CUDA's fused Adam/AdamW roundings with torch operations, about
twenty passes over each tensor (about 20 ns per element on one thread, against 0.7 ns for
the CPU's own fused kernel). This C loop does it in one vectorized pass (about 0.8 ns), for contiguous float32
tensors (``benchmarks/results/replay-arithmetic/run3.txt``); ``foreach_adam_math.py``'s kernels likewise.
A large tensor is split across the writer's threads (``torch.get_num_threads()``, which the
writer sets to ``writer_threads``): elementwise, so the same bits as one call.
The tests hold both roads to the same exact reference. Compiled once per source version into the user's cache (``cbuild.py``) by
``cc -O3 -fno-math-errno -fno-trapping-math -ffp-contract=off``: where no compiler exists, or
``OVERLAPCKPT_NATIVE=0``, the torch road runs. Used by the writer; imports neither side.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import threading
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


def _in_parallel(function: Any, tensors: list[torch.Tensor], has_max: bool, scalars: tuple[Any, ...]) -> None:
    """``function(pointers..., count, *scalars)`` over the tensors, split across the writer's threads where large.

    The update is elementwise, so the chunks are independent and the result is the same bits
    as one call; each call releases the GIL (ctypes.CDLL), so the chunks run at once.
    """
    count = tensors[0].numel()
    bases = [t.data_ptr() for t in tensors[:4]] + [tensors[4].data_ptr() if has_max else None]
    threads = _threads()
    if threads == 1 or count < PARALLEL_MIN_ELEMENTS:
        function(*bases, count, *scalars)
        return
    per_thread = -(-count // threads)
    per_thread = -(-per_thread // _CHUNK_ALIGN) * _CHUNK_ALIGN
    pool = _executor(threads)
    futures = []
    for begin in range(0, count, per_thread):
        n = min(per_thread, count - begin)
        pointers = [None if b is None else b + 4 * begin for b in bases]  # float32: 4 bytes an element
        futures.append(pool.submit(functools.partial(function, *pointers, n, *scalars)))
    for future in futures:
        future.result()  # every chunk done (and any error raised) before the tensors are read


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
    _in_parallel(lib.overlapckpt_cuda_fused_adam_f32, tensors, has_max, (
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
    _in_parallel(lib.overlapckpt_cuda_foreach_adam_f32, tensors, has_max, (
        scalars.weight_decay, scalars.decay, scalars.lerp_weight, scalars.beta2, scalars.one_minus_beta2, scalars.eps,
        scalars.step_size, scalars.bias_correction2_sqrt, int(scalars.decoupled_weight_decay), int(scalars.maximize),
        int(scalars.capturable),
    ))
    return True
