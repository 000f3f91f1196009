"""A pipelined snapshot's landing page: the writer writes a slot's entries while the trainer still copies it.

Shared by both processes: ``train/copying/slots.py`` owns the page (one per training
process, shared memory like a host slot) and ``writer/slot_landing.py`` reads it.

A window-1 snapshot is copied in batches in slot order, on the side stream (a CUDA stream,
or a worker thread on the CPU), and its persist request goes out as soon as its boundary is
final, while the batches still run (``train/lifecycle/pipelined_persist.py``). The writer
plans its DCP save, opens its files and writes each entry once the trainer has published
that the slot's bytes up to that entry's end hold the snapshot. The copy and the write
overlap instead of following one another (``docs/benchmarks.md``, "Time to durable").

The page's words, each one aligned 64-bit word (a load or store of it is one access):

- ``REQUEST``: the persist request the page is about, written before that request is sent;
- ``LANDED``: how many bytes of the slot, from its start, hold the snapshot; ``ALL_LANDED``
  once every copy is done (and the figures below are written), ``ABANDONED`` if the copy
  failed (the writer refuses the checkpoint);
- ``COPY_NS``, ``COPIED_BYTES``, ``LANDED_AFTER_REQUEST_NS``: the copy's figures for the
  manifest's stats and ledger, written before ``ALL_LANDED``.

Stores are made with release and loads with acquire by the native helper
(``csrc/landing_word.c``). Without it, plain stores and loads are used on x86-64 only, whose
memory order keeps stores, and loads, in program order; elsewhere no snapshot is pipelined
(``pipelining_supported``).
"""

from __future__ import annotations

import ctypes
import platform
from pathlib import Path
from typing import Any

from .cbuild import NativeLibrary, build_c_library, c_library_path

REQUEST, LANDED, COPY_NS, COPIED_BYTES, LANDED_AFTER_REQUEST_NS = range(5)
WORDS = 8
PAGE_BYTES = 4096
ALL_LANDED = 1 << 62  # above any slot's size: every wait for an entry's end returns
ABANDONED = -1

SOURCE = Path(__file__).resolve().parent / "csrc" / "landing_word.c"
FLAGS = ["-O2"]


def library_path() -> Path | None:
    return c_library_path(SOURCE, "landing_word", FLAGS, [])


def build(quiet: bool = True) -> Path | None:
    """Compile the helper if it is not built yet; its path, or None where it cannot be built."""
    return build_c_library(SOURCE, "landing_word", FLAGS, [], "landing words use plain loads and stores (x86-64 only)", quiet)


# PyDLL: each call lasts nanoseconds and keeps the GIL.
_library = NativeLibrary(
    library_path, build, ctypes.PyDLL,
    {
        "overlapckpt_store_release": [ctypes.c_void_p, ctypes.c_int64],
        "overlapckpt_load_acquire": [ctypes.c_void_p, ctypes.c_void_p],
    },
    "landing words use plain loads and stores (x86-64 only)",
)

_ORDERED_PLAIN_ACCESS = platform.machine().lower() in ("x86_64", "amd64")


def pipelining_supported() -> bool:
    """Whether landing words can be published in order here: the native helper, or x86-64's own memory order."""
    return _library.get() is not None or _ORDERED_PLAIN_ACCESS


class LandingWords:
    """The words of one landing page, over a shared mapping (the caller keeps the mapping alive)."""

    def __init__(self, address: int) -> None:
        self._address = address
        self._words = (ctypes.c_int64 * WORDS).from_address(address)
        self._out = ctypes.c_int64()
        self._native = _library.get()

    def read(self, word: int) -> int:
        if self._native is None:
            return int(self._words[word])
        self._native.overlapckpt_load_acquire(self._address + 8 * word, ctypes.addressof(self._out))
        return int(self._out.value)

    def write(self, word: int, value: int) -> None:
        if self._native is None:
            self._words[word] = value
            return
        self._native.overlapckpt_store_release(self._address + 8 * word, value)


def apply_landed_figures(stats: dict[str, Any], ledger: dict[str, Any], copy_s: float, copied_nbytes: int, landed_after_request_s: float) -> None:
    """A pipelined request's stats and ledger (as sent, before its copies landed) completed with the copy's figures."""
    stats["copy_s"] = copy_s
    stats["copied_nbytes"] = copied_nbytes
    for group in ledger.get("groups", []):
        group["landed_s"] = landed_after_request_s
    ledger["complete_s"] = landed_after_request_s
