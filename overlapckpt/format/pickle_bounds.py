"""Bounds a pickle from storage must keep before it is unpickled: nothing it claims may size an allocation.

CPython's C unpickler sizes its memo by the largest index a ``PUT`` names: a 9-byte pickle
(``b"\\x80\\x02Nr" + pack("<I", 1 << 26) + b"."``) allocates 512 MiB before anything could
refuse it, and a larger index exhausts the host. An honest pickler numbers its memo
0, 1, 2, ... as it goes, so an index past the entries stored so far is refused here, by a
walk of the opcodes before unpickling: nothing is built, no global is looked up. So is a
length that runs past the end of the data, a byte that is no opcode, and a pickle with no
STOP. Each argument is skipped by its length as ``pickletools`` describes it, not decoded
(``pickletools.genops`` decodes every one: 1.5 s for the 8.8 MB metadata of 30,000 tensors,
against 0.9 s for the walk in Python and 16 ms for the same walk in C, ``native_pickle_walk.py``,
where a compiler built it): a malformed text argument of protocol 0 passes this walk, and the
unpickler refuses it. Pickles that passed are remembered by their SHA-256 and length, so the
same bytes are walked once per process.
"""

from __future__ import annotations

import hashlib
import pickletools

from ..errors import UnsafeCheckpointError
from .native_pickle_walk import (
    WALK_BAD_LENGTH,
    WALK_GET_UNSTORED,
    WALK_NO_NEWLINE,
    WALK_NO_OPCODE,
    WALK_NO_STOP,
    WALK_OK,
    WALK_PAST_END,
    WALK_PUT_OUT_OF_ORDER,
    WALK_TEXT_INDEX,
    WalkOutcome,
    native_walk,
)

# Pickles that passed, by (length, SHA-256); past this many the memory starts afresh.
PASSED_MEMORY_ENTRIES = 64
_passed: set[tuple[int, bytes]] = set()


def check_pickle_bounds(data: bytes, where: str) -> None:
    """Raise UnsafeCheckpointError if ``data`` names a memo slot it never filled, or is cut or malformed."""
    digest = (len(data), hashlib.sha256(data).digest())
    if digest in _passed:
        return  # these very bytes passed before
    _scan(data, where)
    if len(_passed) >= PASSED_MEMORY_ENTRIES:
        _passed.clear()
    _passed.add(digest)


def _scan(data: bytes, where: str) -> None:
    """Walk the opcodes in C where the native helper is built (``native_pickle_walk.py``), else in Python."""
    found = native_walk(data, _ARGUMENTS)
    if found is None or found.outcome == WALK_TEXT_INDEX:  # no library; or a protocol-0 index the C walk leaves to Python
        _walk(data, where)
    elif found.outcome != WALK_OK:
        raise _refusal(found, data, where)


def _refusal(found: WalkOutcome, data: bytes, where: str) -> UnsafeCheckpointError:
    """The refusal of what either walk found, worded once for both."""
    at, index, stored = found.position, found.index, found.stored
    malformed = {
        WALK_NO_STOP: f"it ends at byte {len(data)} before its STOP opcode",
        WALK_NO_OPCODE: f"byte {at} is {index:#04x}, which is no pickle opcode",
        WALK_NO_NEWLINE: f"the opcode at byte {at} has no end of line",
        WALK_BAD_LENGTH: f"the opcode at byte {at} has a length of {index}",
        WALK_PAST_END: f"the opcode at byte {at} runs past the end (byte {len(data)})",
    }
    if found.outcome == WALK_PUT_OUT_OF_ORDER:
        return UnsafeCheckpointError(
            f"{where} puts memo entry {index} at byte {at} after {stored} entries: an honest pickle numbers "
            "them in order; refused before unpickling, which would size its memo by it"
        )
    if found.outcome == WALK_GET_UNSTORED:
        return UnsafeCheckpointError(f"{where} reads memo entry {index} at byte {at}, of {stored} stored; refused")
    return UnsafeCheckpointError(f"{where} is not a well-formed pickle: {malformed[found.outcome]}")


def _walk(data: bytes, where: str) -> None:
    """Walk the opcodes (their arguments skipped by their lengths, nothing decoded), keeping the memo's count."""
    stored = 0
    pos, end = 0, len(data)
    while True:
        if pos >= end:
            raise _refusal(WalkOutcome(WALK_NO_STOP, end, 0, stored), data, where)
        code = data[pos]
        kind = _ARGUMENTS[code]
        if kind is None:
            raise _refusal(WalkOutcome(WALK_NO_OPCODE, pos, code, stored), data, where)
        start, pos = pos, pos + 1
        if kind >= 0:  # a fixed length
            argument_at, pos = pos, pos + kind
        elif kind == _UP_TO_NEWLINE or kind == _TWO_LINES:
            argument_at = pos
            for _ in range(1 if kind == _UP_TO_NEWLINE else 2):
                newline = data.find(b"\n", pos)
                if newline < 0:
                    raise _refusal(WalkOutcome(WALK_NO_NEWLINE, start, 0, stored), data, where)
                pos = newline + 1
        else:  # a length first, then that many bytes
            width, signed = _LENGTH_PREFIXES[kind]
            if pos + width > end:
                raise _refusal(WalkOutcome(WALK_PAST_END, start, 0, stored), data, where)
            length = int.from_bytes(data[pos : pos + width], "little", signed=signed)
            if length < 0:
                raise _refusal(WalkOutcome(WALK_BAD_LENGTH, start, length, stored), data, where)
            argument_at, pos = pos + width, pos + width + length
        if pos > end:
            raise _refusal(WalkOutcome(WALK_PAST_END, start, 0, stored), data, where)
        if code == _MEMOIZE:
            stored += 1
        elif code in _PUTS or code in _GETS:
            index = _memo_index(code, data[argument_at:pos], where, start)
            if code in _PUTS:
                if index > stored:
                    raise _refusal(WalkOutcome(WALK_PUT_OUT_OF_ORDER, start, index, stored), data, where)
                stored += index == stored
            elif index >= stored:
                raise _refusal(WalkOutcome(WALK_GET_UNSTORED, start, index, stored), data, where)
        elif code == _STOP:
            return


def _memo_index(code: int, argument: bytes, where: str, at: int) -> int:
    """The memo index a PUT or GET names (text in protocol 0, little-endian in the binary forms)."""
    if code in _TEXT_MEMO_OPCODES:
        try:
            return int(argument.rstrip(b"\n"))
        except ValueError:
            raise UnsafeCheckpointError(f"{where} is not a well-formed pickle: the memo index at byte {at} is {argument[:20]!r}") from None
    return int.from_bytes(argument, "little")


def _argument_kinds() -> list[int | None]:
    """Per opcode byte: its argument's fixed length (0: none), or how its length is found; None: no opcode."""
    kinds: list[int | None] = [None] * 256
    for opcode in pickletools.opcodes:
        arg = opcode.arg
        if arg is None:
            kind = 0
        elif arg.name == "stringnl_noescape_pair":  # GLOBAL and INST: module and name, a line each
            kind = _TWO_LINES
        elif arg.n >= 0:
            kind = arg.n
        else:
            kind = {pickletools.UP_TO_NEWLINE: _UP_TO_NEWLINE}.get(arg.n, arg.n)
        kinds[ord(opcode.code.encode("latin-1"))] = kind
    return kinds


_UP_TO_NEWLINE = -1
_TWO_LINES = -100
# pickletools' markers of a length taken from the argument's first bytes: (its width, signed).
_LENGTH_PREFIXES = {
    pickletools.TAKEN_FROM_ARGUMENT1: (1, False),
    pickletools.TAKEN_FROM_ARGUMENT4: (4, True),
    pickletools.TAKEN_FROM_ARGUMENT4U: (4, False),
    pickletools.TAKEN_FROM_ARGUMENT8U: (8, False),
}
_ARGUMENTS = _argument_kinds()


def _code(name: str) -> int:
    return next(ord(o.code.encode("latin-1")) for o in pickletools.opcodes if o.name == name)


_PUTS = frozenset(_code(name) for name in ("PUT", "BINPUT", "LONG_BINPUT"))
_GETS = frozenset(_code(name) for name in ("GET", "BINGET", "LONG_BINGET"))
_MEMOIZE = _code("MEMOIZE")
_STOP = _code("STOP")
_TEXT_MEMO_OPCODES = frozenset({_code("PUT"), _code("GET")})
