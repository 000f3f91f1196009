"""Which files of a checkpoint a node holds, as few bytes as the set takes: every one, a bitmap, or the indices.

Runs on every rank of a restore from the node-local tiers (``node_listings.py``): each node's
digest of a checkpoint carries this, and every rank receives every node's. A bitmap is a bit
per file, 1 KB at 8,192 files; but a node usually holds all of a checkpoint (one node, or
every rank's replica) or a few of its files (its ranks' shards and its partners' replicas on
many nodes), so the encoding is the shortest of:

- ``ALL``: one byte, every file held;
- ``BITMAP``: a byte, then bit i of the little-endian integer for file i;
- ``INDICES``: a byte, then the held indices in ascending order, each as its gap from the one
  before less one, in LEB128 (7 bits a byte): 16 files of 8,194 in about 20 bytes.

Decoding is total: a held index beyond the file table, an unknown tag or a cut number holds
nothing more (the value comes from another rank of the job, and a file counts as held only
where a digest says so: at worst a checkpoint is taken as incomplete and the root is read).
"""

from __future__ import annotations

ALL = 2
BITMAP = 0
INDICES = 1


def encode_held(held: int, files: int) -> bytes:
    """``held`` (bit i set: file i of ``files`` is held) in the shortest of the three forms."""
    every = (1 << files) - 1
    held &= every
    if files and held == every:
        return bytes([ALL])
    bitmap = bytes([BITMAP]) + held.to_bytes((files + 7) // 8, "little")
    indices = bytearray([INDICES])
    previous = -1
    index = 0
    remaining = held
    while remaining:
        if remaining & 1:
            _leb128(indices, index - previous - 1)
            previous = index
            if len(indices) >= len(bitmap):
                return bitmap  # the bitmap is shorter already
        remaining >>= 1
        index += 1
    return bytes(indices) if len(indices) < len(bitmap) else bitmap


def decode_held(encoded: bytes, files: int) -> int:
    """The held set ``encode_held`` made (bit i: file i), none beyond ``files``."""
    every = (1 << files) - 1
    if not encoded:
        return 0
    tag, body = encoded[0], encoded[1:]
    if tag == ALL:
        return every
    if tag == BITMAP:
        return int.from_bytes(body, "little") & every
    if tag != INDICES:
        return 0
    held, index, gap, shift = 0, -1, 0, 0
    for byte in body:
        gap |= (byte & 0x7F) << shift
        if byte & 0x80:
            shift += 7
            if shift > 63:  # no file table is that long
                return held
            continue
        index += gap + 1
        if index >= files:
            return held
        held |= 1 << index
        gap, shift = 0, 0
    return held


def _leb128(out: bytearray, value: int) -> None:
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
