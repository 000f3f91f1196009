"""The opcode walk before any unpickling: every honest pickle passes, memo abuse, cut data and non-opcodes are refused.

Compared with ``pickletools.genops`` (the walk this replaced): over pickles of many objects at
every protocol, and those pickles with each byte changed, the walk refuses nothing genops
accepts, and it refuses every memo index out of order in each of the six PUT and GET forms.
"""

from __future__ import annotations

import pickle
import pickletools
import random
import struct

import pytest

from overlapckpt.errors import UnsafeCheckpointError
from overlapckpt.format.pickle_bounds import _scan

OBJECTS = [
    None, True, 1, -5, 300, 70000, 2**70, -(2**70), 1.5, "x", "é" * 30, b"b" * 300, bytearray(b"ab"), (1, 2), (), [1, [2, {3: 4}]],
    {"a": (1, "b")}, {1, 2}, frozenset([3]), ["shared"] * 3, [b"x" * 70000],
]
CHANGED_POSITIONS = 40  # per pickle, chosen at random: each changed to 8 bytes


def _genops_accepts(data: bytes) -> bool:
    stored = 0
    try:
        for opcode, arg, _ in pickletools.genops(data):
            if opcode.name in ("PUT", "BINPUT", "LONG_BINPUT"):
                if arg > stored:
                    return False
                stored += arg == stored
            elif opcode.name == "MEMOIZE":
                stored += 1
            elif opcode.name in ("GET", "BINGET", "LONG_BINGET") and arg >= stored:
                return False
    except Exception:  # noqa: BLE001 - genops' own refusal
        return False
    return True


def _walk_accepts(data: bytes) -> bool:
    try:
        _scan(data, "test")
    except UnsafeCheckpointError:
        return False
    return True


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_every_honest_pickle_passes_and_a_changed_byte_is_never_refused_where_genops_accepts_it(protocol):
    rng = random.Random(protocol)
    for obj in [*OBJECTS, OBJECTS]:
        honest = pickle.dumps(obj, protocol=protocol)
        assert _walk_accepts(honest), (protocol, obj)
        for i in sorted(rng.sample(range(len(honest)), min(CHANGED_POSITIONS, len(honest)))):
            for byte in (0x00, 0x71, 0x72, 0x68, 0x6A, 0x94, 0xFF, rng.randrange(256)):
                changed = honest[:i] + bytes([byte]) + honest[i + 1 :]
                if _genops_accepts(changed):
                    assert _walk_accepts(changed), (protocol, changed[:40])


@pytest.mark.parametrize(
    ("pickled", "message"),
    [
        (b"\x80\x02Nr" + struct.pack("<I", 1 << 26) + b".", "puts memo entry 67108864 at byte 3 after 0 entries"),  # LONG_BINPUT
        (b"\x80\x02Nq\x05.", "puts memo entry 5 at byte 3 after 0 entries"),  # BINPUT
        (b"Np9999999\n.", "puts memo entry 9999999 at byte 1 after 0 entries"),  # PUT, protocol 0
        (b"\x80\x02Nq\x00h\x01.", "reads memo entry 1 at byte 5, of 1 stored"),  # BINGET
        (b"\x80\x02j" + struct.pack("<I", 7) + b".", "reads memo entry 7 at byte 2, of 0 stored"),  # LONG_BINGET
        (b"g3\n.", "reads memo entry 3 at byte 0, of 0 stored"),  # GET, protocol 0
        (b"\x80\x02Np", "has no end of line"),
        (b"\x80\x02X" + struct.pack("<I", 1 << 30) + b"ab.", "runs past the end"),
        (b"\x80\x02T" + struct.pack("<i", -1) + b".", "has a length of -1"),
        (b"\x80\x02N", "before its STOP opcode"),
        (b"\x80\x02\xfe.", "byte 2 is 0xfe, which is no pickle opcode"),
        (b"pXY\n.", "the memo index at byte 0 is b'XY\\n'"),
    ],
)
def test_memo_abuse_and_malformed_pickles_are_refused_naming_the_byte(pickled, message):
    with pytest.raises(UnsafeCheckpointError, match=message.replace("(", r"\(").replace("\\n", "\\\\n")):
        _scan(pickled, "test")
