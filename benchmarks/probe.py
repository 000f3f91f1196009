"""The GPU probe's pinning check: are overlapckpt's host buffers pinned, and what do pinning and copies cost?

    python benchmarks/probe.py --out RESULTS_DIR/probe/pinning.json

Measures, on one 2 GiB buffer of each kind: reserving a shared-memory buffer
(``posix_fallocate``), page-locking it (``cudaHostRegister``, which a checkpoint must
not pay inside a hook), ``is_pinned()`` before and after, the device-to-host
bandwidth into pageable memory, into torch's own pinned memory (``cudaHostAlloc``)
and into the registered shared buffer, and the host time of one
``StreamCopier.copy_async`` (over ``CudaDevice``) of the whole buffer against its copy time. It
reports; it does not pass or fail (the GPU tests assert).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]

from measure import machine_description  # noqa: E402

from overlapckpt.hostbuf import SharedHostBuffer  # noqa: E402
from overlapckpt.train.copying.cuda_device import CudaDevice  # noqa: E402
from overlapckpt.train.copying.stream_copier import StreamCopier  # noqa: E402

PROBE_NBYTES = 2 << 30
COPY_REPEATS = 3


def _best_d2h_bytes_per_s(src: torch.Tensor, dst: torch.Tensor) -> float:
    """The best of a few device-to-host copies, timed with events on the current stream."""
    best = 0.0
    for _ in range(COPY_REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        best = max(best, src.numel() * src.element_size() / (start.elapsed_time(end) / 1000.0))
    return best


def probe(nbytes: int) -> dict[str, Any]:
    device = torch.device("cuda")
    src = torch.full((nbytes,), 7, dtype=torch.uint8, device=device)
    out: dict[str, Any] = {"machine": machine_description(device), "nbytes": nbytes}

    started = time.perf_counter()
    buffer = SharedHostBuffer(nbytes, pin=None)
    out["shm_reserve_s"] = time.perf_counter() - started
    out["is_pinned_before_register"] = buffer.tensor.is_pinned()
    started = time.perf_counter()
    err = torch.cuda.cudart().cudaHostRegister(buffer.tensor.data_ptr(), nbytes, 0)
    out["register_s"] = time.perf_counter() - started
    out["register_error"] = int(err)
    registered = int(err) == 0
    try:
        out["is_pinned_after_register"] = buffer.tensor.is_pinned()
        out["register_s_per_gib"] = out["register_s"] / (nbytes / 2**30)

        pageable = torch.empty(nbytes, dtype=torch.uint8)
        out["d2h_pageable_bytes_per_s"] = _best_d2h_bytes_per_s(src, pageable)
        del pageable
        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        out["d2h_cuda_host_alloc_bytes_per_s"] = _best_d2h_bytes_per_s(src, pinned)
        del pinned
        out["d2h_registered_shm_bytes_per_s"] = _best_d2h_bytes_per_s(src, buffer.tensor)

        copier = StreamCopier(CudaDevice(device))
        torch.cuda.synchronize()
        started = time.perf_counter()
        ticket = copier.copy_async([src], [buffer.tensor])
        out["copy_async_host_s"] = time.perf_counter() - started
        out["copy_async_in_flight_after_return"] = not ticket.done_event.query()
        copier.wait(ticket)
        out["copy_async_copy_s"] = ticket.start_event.elapsed_time(ticket.done_event) / 1000.0
        out["landed"] = bool((buffer.tensor[:: 1 << 20] == 7).all())
    finally:
        if registered:
            torch.cuda.cudart().cudaHostUnregister(buffer.tensor.data_ptr())
        buffer.release()
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the JSON file to write")
    parser.add_argument("--nbytes", type=int, default=PROBE_NBYTES, help="bytes per buffer")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("the pinning probe needs a CUDA device")
    result = probe(args.nbytes)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    gb = 1e9
    print(
        f"pinned: {result['is_pinned_after_register']} (before register: {result['is_pinned_before_register']}); "
        f"register {result['register_s_per_gib'] * 1000:.0f} ms/GiB; D2H GB/s: pageable "
        f"{result['d2h_pageable_bytes_per_s'] / gb:.1f}, cudaHostAlloc {result['d2h_cuda_host_alloc_bytes_per_s'] / gb:.1f}, "
        f"registered shm {result['d2h_registered_shm_bytes_per_s'] / gb:.1f}; copy_async host "
        f"{result['copy_async_host_s'] * 1000:.2f} ms vs copy {result['copy_async_copy_s'] * 1000:.1f} ms"
    )
    return result


if __name__ == "__main__":
    main()
