"""Start the disk's writeback of a file's bytes while the rest is still being written.

Runs in the writer process. A checkpoint is durable only after ``fsync``; without a
hint, the kernel keeps every written page dirty in the page cache until the fsync (or
its own flusher, seconds later), so the disk idles while the shards are produced and
then the fsync waits for all of it. Asking for writeback of each range as soon as it
is written lets the disk work during the rest of the write, and the fsync waits only
for the tail. Measured on the 2-core machine's disk (768 MiB, 32 MiB ranges, five
runs): write + fsync took 0.67 s (median; 0.63-1.54) plain and 0.43 s (0.33-0.48)
with ``sync_file_range(SYNC_FILE_RANGE_WRITE)``.

``sync_file_range`` is Linux's; elsewhere ``posix_fadvise(POSIX_FADV_DONTNEED)``
(which also starts writeback of dirty pages on Linux) where it exists, else nothing.
Either is only a hint: durability still comes from DCP's fsync.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Callable

# Ask for writeback once this many bytes were written since the last request: large
# enough to cost nothing per call, small enough that the disk starts early.
WRITEBACK_EVERY_BYTES = 32 << 20
_SYNC_FILE_RANGE_WRITE = 2


def _sync_file_range() -> Callable[[int, int, int], None] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        fn = ctypes.CDLL(name, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    fn.restype = ctypes.c_int

    def start(fd: int, offset: int, nbytes: int) -> None:
        fn(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)  # a failure only loses the hint

    return start


def _fadvise() -> Callable[[int, int, int], None] | None:
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return None

    def start(fd: int, offset: int, nbytes: int) -> None:
        try:
            advise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass  # a failure only loses the hint

    return start


start_writeback: Callable[[int, int, int], None] | None = _sync_file_range() or _fadvise()
