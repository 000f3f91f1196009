"""Bounds a pickle from storage must keep before it is unpickled: nothing it claims may size an allocation.

CPython's C unpickler sizes its memo by the largest index a ``PUT`` names: a 9-byte pickle
(``b"\\x80\\x02Nr" + pack("<I", 1 << 26) + b"."``) allocates 512 MiB before anything could
refuse it, and a larger index exhausts the host. An honest pickler numbers its memo
0, 1, 2, ... as it goes, so an index past the entries stored so far is refused here, by a
scan of the opcodes (``pickletools.genops``: nothing is built, no global is looked up), as
is a length that runs past the end of the data.

The scan is pure Python: 1.2 s for the 8.8 MB metadata of 30,000 tensors, and a verified
load reads the metadata twice (a check pass, then the read). Pickles that passed are
remembered by their SHA-256 and length, so the same bytes are scanned once per process.
"""

from __future__ import annotations

import hashlib
import pickletools

from ..errors import UnsafeCheckpointError

_PUTS = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})
_GETS = frozenset({"GET", "BINGET", "LONG_BINGET"})
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
    stored = 0
    try:
        for opcode, arg, pos in pickletools.genops(data):
            if opcode.name in _PUTS:
                if not isinstance(arg, int) or arg > stored:
                    raise UnsafeCheckpointError(
                        f"{where} puts memo entry {arg} at byte {pos} after {stored} entries: an honest pickle numbers "
                        "them in order; refused before unpickling, which would size its memo by it"
                    )
                stored += arg == stored
            elif opcode.name == "MEMOIZE":
                stored += 1
            elif opcode.name in _GETS and (not isinstance(arg, int) or arg >= stored):
                raise UnsafeCheckpointError(f"{where} reads memo entry {arg} at byte {pos}, of {stored} stored; refused")
    except UnsafeCheckpointError:
        raise
    except Exception as e:  # genops: a length past the end, an unknown opcode, no STOP
        raise UnsafeCheckpointError(f"{where} is not a well-formed pickle: {type(e).__name__}: {e}") from e
