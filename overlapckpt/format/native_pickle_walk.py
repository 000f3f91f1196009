"""The optional native walk of a pickle's opcodes (``csrc/pickle_walk.c``): built on first use where a C compiler exists.

Why native: ``pickle_bounds.py`` walks every opcode of a pickle from storage before it is
unpickled, one Python loop turn each: 0.9 s for the 8.8 MB ``.metadata`` of 30,000 tensors,
the largest part of a verified load that only DCP's own work exceeds. The C loop skips the
same bytes (it is handed the same table of argument kinds) in milliseconds. Nothing requires
it: where no compiler is found, or ``OVERLAPCKPT_NATIVE=0``, the Python walk runs, and the
tests hold the two to the same outcome on the same bytes.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..cbuild import NativeLibrary, build_c_library, c_library_path

SOURCE = Path(__file__).resolve().parents[1] / "csrc" / "pickle_walk.c"
FLAGS = ["-O2"]
# Outcomes (csrc/pickle_walk.c's enum).
WALK_OK, WALK_NO_STOP, WALK_NO_OPCODE, WALK_NO_NEWLINE, WALK_BAD_LENGTH, WALK_PAST_END = 0, 1, 2, 3, 4, 5
WALK_PUT_OUT_OF_ORDER, WALK_GET_UNSTORED, WALK_TEXT_INDEX = 6, 7, 8
NO_OPCODE_KIND = -128  # the C table's mark of a byte that is no opcode


@dataclass(frozen=True)
class WalkOutcome:
    """What the native walk found: an outcome, the byte it concerns, a memo index and the entries stored by then."""

    outcome: int
    position: int
    index: int
    stored: int


def library_path() -> Path | None:
    return c_library_path(SOURCE, "pickle_walk", FLAGS, [])


def build(quiet: bool = True) -> Path | None:
    return build_c_library(SOURCE, "pickle_walk", FLAGS, [], "pickles are walked in Python", quiet)


# CDLL: the call releases the GIL (milliseconds over megabytes, on a load's reader thread).
_walk = NativeLibrary(
    library_path, build, ctypes.CDLL,
    {"overlapckpt_pickle_walk": [ctypes.c_char_p, ctypes.c_uint64, ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_int64)]},
    "pickles are walked in Python",
)
_tables: dict[tuple[int | None, ...], ctypes.Array[ctypes.c_int32]] = {}


def native_walk(data: bytes, kinds: Sequence[int | None]) -> WalkOutcome | None:
    """Walk ``data`` in C with ``kinds`` (per opcode byte: its argument's kind; None: no opcode); None: no library here."""
    library = _walk.get()
    if library is None:
        return None
    key = tuple(kinds)
    table = _tables.get(key)
    if table is None:
        table = _tables[key] = (ctypes.c_int32 * 256)(*(NO_OPCODE_KIND if k is None else k for k in kinds))
    out = (ctypes.c_int64 * 4)()
    library.overlapckpt_pickle_walk(data, len(data), table, out)
    return WalkOutcome(*out)
