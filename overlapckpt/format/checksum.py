"""Checksum algorithms for stored bytes: CRC32C when its package is installed, CRC-32 otherwise.

The manifest records which algorithm a checkpoint was written with, so a reader
uses the same one whatever is installed where it runs. Measured on one core of the
2-core build VM (``benchmarks/checksum_speed.py``): the ``crc32c`` package hashes
8-13 GB/s (hardware CRC32C), ``zlib.crc32`` 1.6-4 GB/s. CRC32C is also the checksum
S3 can verify on upload. ``crc32c`` is a dependency, so an installed overlapckpt
uses it; ``zlib.crc32`` is the fallback of a source checkout run without it (the GPU
machine has no ``crc32c`` package), since it needs nothing beyond the standard library.

Both are 32-bit CRCs: every single-bit error, and every burst up to 32 bits, in a
blob changes its checksum.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable
from typing import Any

from ..errors import ConfigError

CRC32C = "crc32c"  # Castagnoli polynomial, the ``crc32c`` package
CRC32 = "crc32"  # zlib's CRC-32 (IEEE polynomial), always available
ALGORITHMS = (CRC32C, CRC32)
# Set to "crc32" to write checkpoints that a machine without the crc32c package can verify.
ALGORITHM_ENV = "OVERLAPCKPT_CHECKSUM"

# (buffer, running value) -> new running value; the running value starts at 0.
Updater = Callable[[Any, int], int]


def _crc32c_updater() -> Updater | None:
    try:
        import crc32c
    except ImportError:
        return None
    return crc32c.crc32c


def default_algorithm() -> str:
    """The algorithm new checkpoints use: ``$OVERLAPCKPT_CHECKSUM``, else CRC32C if installed, else CRC-32."""
    chosen = os.environ.get(ALGORITHM_ENV)
    if chosen:
        updater(chosen)  # raises ConfigError naming the fix when it cannot run here
        return chosen
    return CRC32C if _crc32c_updater() is not None else CRC32


def updater(algorithm: str) -> Updater:
    """The incremental update function of ``algorithm``; ConfigError if it cannot run here."""
    if algorithm == CRC32:
        return zlib.crc32
    if algorithm == CRC32C:
        fn = _crc32c_updater()
        if fn is None:
            raise ConfigError(
                "checksum algorithm 'crc32c' needs the crc32c package, which is not installed; "
                "pip install crc32c (a dependency of overlapckpt), or write with OVERLAPCKPT_CHECKSUM=crc32"
            )
        return fn
    raise ConfigError(f"checksum algorithm {algorithm!r} is unknown; use one of {list(ALGORITHMS)}")


def hex32(value: int) -> str:
    """How a checksum is written in the manifest: 8 lowercase hex digits."""
    return f"{value & 0xFFFFFFFF:08x}"
