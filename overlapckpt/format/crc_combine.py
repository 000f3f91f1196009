"""The checksum of two concatenated buffers from the checksums of each: zlib's ``crc32_combine``, for both CRCs.

A blob as stored is torch.save's framing around the tensor's raw bytes. A load checks
the whole blob against the manifest's blob checksum and the raw bytes against the
checksum of the host snapshot, in one pass: it hashes the framing before, the data
and the framing after apart, and combines the three (``combine``), in microseconds,
where hashing the data twice would cost a second pass over the state.

This is zlib's algorithm (``crc32_combine_op``, multiplication modulo the CRC's
polynomial in GF(2)), for the reflected, pre- and post-inverted CRCs used here.
"""

from __future__ import annotations

from functools import lru_cache

from .checksum import CRC32, CRC32C

# The reflected polynomials: zlib's CRC-32 (IEEE) and CRC-32C (Castagnoli).
_POLYNOMIALS = {CRC32: 0xEDB88320, CRC32C: 0x82F63B78}


def _multiply(a: int, b: int, poly: int) -> int:
    """a(x) * b(x) modulo the polynomial (reflected: bit 31 is x^0)."""
    m = 1 << 31
    product = 0
    while True:
        if a & m:
            product ^= b
            if (a & (m - 1)) == 0:
                break
        m >>= 1
        b = (b >> 1) ^ poly if b & 1 else b >> 1
    return product


@lru_cache(maxsize=None)
def _powers(poly: int) -> tuple[int, ...]:
    """x^(2^k) modulo the polynomial, for k = 0..31."""
    out = []
    p = 1 << 30  # x^1
    for _ in range(32):
        out.append(p)
        p = _multiply(p, p, poly)
    return tuple(out)


@lru_cache(maxsize=256)  # a snapshot's chunks share one length: its operator is built once
def _x_to_8n(n: int, poly: int) -> int:
    """x^(8n) modulo the polynomial: the operator that appends n zero bytes."""
    powers = _powers(poly)
    p = 1 << 31  # x^0
    k = 3  # 8n = n * 2^3
    while n:
        if n & 1:
            p = _multiply(powers[k & 31], p, poly)
        n >>= 1
        k += 1
    return p


def combine(algorithm: str, first: int, second: int, second_length: int) -> int:
    """The checksum of A + B, from the checksum of A, that of B, and B's length in bytes."""
    poly = _POLYNOMIALS[algorithm]
    return _multiply(_x_to_8n(second_length, poly), first, poly) ^ second
