"""The opcode walk before any unpickling: every honest pickle passes, memo abuse, cut data and non-opcodes are refused.

Compared with ``pickletools.genops`` (the walk this replaced): over pickles of many objects at
every protocol, and those pickles with bytes changed, the walk refuses nothing genops accepts,
and it refuses every memo index out of order in each of the six PUT and GET forms. The native
walk (``csrc/pickle_walk.c``, where a compiler built it) gives the Python walk's outcome, word
for word, on every one of those pickles.
"""

from __future__ import annotations

import pickle
import pickletools
import random
import struct

import pytest

from overlapckpt.errors import UnsafeCheckpointError
from overlapckpt.format import native_pickle_walk
from overlapckpt.format.pickle_bounds import _ARGUMENTS, _refusal, _scan, _walk

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


def _outcome(walk, data: bytes) -> str:
    try:
        walk(data, "test")
    except UnsafeCheckpointError as e:
        return str(e)
    return "passed"


def _native_only(data: bytes, where: str) -> None:
    found = native_pickle_walk.native_walk(data, _ARGUMENTS)
    assert found is not None
    if found.outcome == native_pickle_walk.WALK_TEXT_INDEX:
        _walk(data, where)  # as _scan does: a protocol-0 index the C walk leaves to Python
        return
    if found.outcome != native_pickle_walk.WALK_OK:
        raise _refusal(found, data, where)


needs_native = pytest.mark.skipif(native_pickle_walk.native_walk(b".", _ARGUMENTS) is None, reason="no C compiler here: the Python walk runs")


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


MEMO_AND_MALFORMED = [
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
    (b"\x80\x02X\x01", "the opcode at byte 2 runs past the end"),  # its length cut short
]


def _pattern(message: str) -> str:
    return message.replace("(", r"\(").replace("\\n", "\\\\n")


@pytest.mark.parametrize(("pickled", "message"), MEMO_AND_MALFORMED)
def test_memo_abuse_and_malformed_pickles_are_refused_naming_the_byte(pickled, message, monkeypatch):
    monkeypatch.setattr(native_pickle_walk, "native_walk", lambda data, kinds: None)  # the Python walk
    with pytest.raises(UnsafeCheckpointError, match=_pattern(message)):
        _scan(pickled, "test")


@needs_native
@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_the_native_walk_gives_the_python_walks_outcome_word_for_word(protocol):
    rng = random.Random(100 + protocol)
    cases = [b"", b".", b"\x80\x02", b"\x80\x02\xfe.", b"\x80\x02X\xff\xff\xff", b"\x80\x02\x8e" + b"\xff" * 8 + b"."]
    for obj in [*OBJECTS, OBJECTS]:
        honest = pickle.dumps(obj, protocol=protocol)
        cases += [honest, honest[:-1], honest[: len(honest) // 2]]
        for i in sorted(rng.sample(range(len(honest)), min(CHANGED_POSITIONS, len(honest)))):
            for byte in (0x00, 0x71, 0x72, 0x68, 0x6A, 0x94, 0xFF, rng.randrange(256)):
                cases.append(honest[:i] + bytes([byte]) + honest[i + 1 :])
    for case in cases:
        assert _outcome(_native_only, case) == _outcome(_walk, case), case[:60]


@needs_native
def test_the_native_walk_refuses_memo_abuse_in_each_form():
    for pickled, message in MEMO_AND_MALFORMED:
        with pytest.raises(UnsafeCheckpointError, match=_pattern(message)):
            _native_only(pickled, "test")
