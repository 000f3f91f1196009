"""The optional native helper (``csrc/gather_values.c``): built on first use where a C compiler exists.

Why native: reading tens of thousands of host scalars (Adam's step counters on CUDA) costs
one torch dispatch each from Python, whatever the grouped operation (``_foreach_copy_``,
``stack``, ``item``: 0.2 to 2 µs per tensor, benchmarks/hook_scaling.py). A memcpy loop
in C reads 7,500 of them in microseconds. Nothing else needs it, and nothing requires it:
where no compiler is found, or ``OVERLAPCKPT_NATIVE=0``, ``host_values.py`` uses its
Python twin, which the tests hold to the same bytes.

The library is compiled once per source version into the user's cache directory
(``$XDG_CACHE_HOME/overlapckpt``, else ``~/.cache/overlapckpt``), under a name made of the
source's hash, by ``cc -O2 -shared -fPIC``: a plain shared object with no Python headers,
loaded with ctypes. ``make install`` builds it ahead; a source checkout builds it the first
time a route needs it (about 0.1 s), outside any later step.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

from ...cbuild import NativeLibrary, build_c_library, c_library_path

SOURCE = Path(__file__).resolve().parents[2] / "csrc" / "gather_values.c"


FLAGS = ["-O2"]


def library_path() -> Path | None:
    """Where the built library for this source, compiler and flags lives (None without the source: an installed wheel)."""
    return c_library_path(SOURCE, "gather_values", FLAGS, [])


def build(quiet: bool = True) -> Path | None:
    """Compile the library if it is not built yet; its path, or None where it cannot be built."""
    return build_c_library(SOURCE, "gather_values", FLAGS, [], "host values are gathered by the Python twin", quiet)


# PyDLL, not CDLL: the call keeps the GIL. It lasts microseconds, and a CDLL call releases the
# GIL and must win it back, which waits for any other Python thread for up to the switch
# interval (5 ms) inside optimizer.step().
_gather = NativeLibrary(
    library_path, build, ctypes.PyDLL, {"overlapckpt_gather_values": [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_void_p]},
    "the Python twin is used",
)


def gather_library() -> ctypes.CDLL | None:
    """The loaded library (built on first use), or None: disabled, no compiler, or no source."""
    return _gather.get()
