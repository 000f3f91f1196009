"""Checksum throughput on one core, and what checksums add to persisting a ~150 MiB state through DCP.

    .venv/bin/python benchmarks/checksum_speed.py [--mib 153] [--repeats 5] [--dir /dev/shm]

Prints GB/s for each available CRC implementation (best of ``--repeats`` over one
256 MiB buffer), then the time of ``dcp.save`` of a state of ``--mib`` MiB (the
benchmark's tiny workload is 153.4 MiB) with a plain FileSystemWriter and with
overlapckpt's checksumming writer, per algorithm: best of ``--repeats``, written
under ``--dir`` (tmpfs by default, so the figure is the CPU cost, not the disk's).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
import warnings
import zlib
from collections.abc import Callable
from typing import Any

import torch

BUFFER_BYTES = 256 << 20


def _implementations() -> dict[str, Callable[[Any, int], int]]:
    found: dict[str, Callable[[Any, int], int]] = {"zlib.crc32 (CRC-32)": zlib.crc32}
    try:
        import crc32c

        found["crc32c package (CRC32C)"] = crc32c.crc32c
    except ImportError:
        pass
    try:
        import google_crc32c

        found["google-crc32c (CRC32C)"] = google_crc32c.extend
    except ImportError:
        pass
    return found


def _best_s(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def checksum_throughput(repeats: int) -> None:
    data = os.urandom(BUFFER_BYTES)
    for name, fn in _implementations().items():
        seconds = _best_s(lambda fn=fn: fn(data, 0), repeats)
        print(f"{name:28s} {BUFFER_BYTES / seconds / 1e9:6.2f} GB/s")


def _state(mib: int) -> dict[str, Any]:
    # Tensors of a few MiB each, as a model's layers are, plus the small items DCP pickles.
    tensor_bytes = 4 << 20
    count = max(1, (mib << 20) // tensor_bytes)
    model = {f"layer{i}.weight": torch.randn(tensor_bytes // 4) for i in range(count)}
    return {"model": model, "optimizer": {"param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": list(range(count))}]}}


def persist_overhead(mib: int, repeats: int, directory: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from overlapckpt.errors import ConfigError
    from overlapckpt.format.checksum import ALGORITHM_ENV, CRC32, CRC32C, updater
    from overlapckpt.format.storage import CheckpointStore

    state = _state(mib)
    nbytes = sum(t.numel() * t.element_size() for t in state["model"].values())
    root = tempfile.mkdtemp(prefix="overlapckpt-bench-", dir=directory)
    store = CheckpointStore(root)

    def save(make_writer: Callable[[str], Any]) -> None:
        name = f"ckpt-{time.perf_counter_ns()}"
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process")
            dcp.save(state, storage_writer=make_writer(name), no_dist=True)
        shutil.rmtree(os.path.join(root, name))

    try:
        print(f"dcp.save of {nbytes / 2**20:.1f} MiB to {directory}, best of {repeats}:")
        plain_s = _best_s(lambda: save(lambda n: FileSystemWriter(os.path.join(root, n))), repeats)
        print(f"  {'plain FileSystemWriter':26s} {plain_s * 1000:7.1f} ms")
        for algorithm in (CRC32C, CRC32):
            try:
                updater(algorithm)
            except ConfigError:
                print(f"  {algorithm:26s} (not installed)")
                continue
            os.environ[ALGORITHM_ENV] = algorithm
            seconds = _best_s(lambda: save(lambda n: store.make_writer(n, before_commit=lambda sums: None)), repeats)
            print(f"  {'checksummed, ' + algorithm:26s} {seconds * 1000:7.1f} ms  (+{(seconds - plain_s) * 1000:.1f} ms)")
        from overlapckpt.format.checksum import default_algorithm
        from overlapckpt.format.manifest import tensor_checksum

        # The writer also takes a checksum of each host tensor for the end-to-end check after a load,
        # in the default algorithm (the loop above left its last one in the environment).
        os.environ.pop(ALGORITHM_ENV, None)
        algorithm = default_algorithm()
        tensors_s = _best_s(lambda: [tensor_checksum(t, algorithm) for t in state["model"].values()], repeats)
        print(f"  {'+ per-tensor ' + algorithm:26s} {tensors_s * 1000:7.1f} ms")
    finally:
        os.environ.pop(ALGORITHM_ENV, None)
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=153)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    args = parser.parse_args()
    torch.set_num_threads(1)
    checksum_throughput(args.repeats)
    persist_overhead(args.mib, args.repeats, args.dir)


if __name__ == "__main__":
    main()
