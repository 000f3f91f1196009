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
import hashlib
import logging
import os
import shutil
import threading
from pathlib import Path

from ...cbuild import compile_into, native_cache_dir

log = logging.getLogger("overlapckpt")

SOURCE = Path(__file__).resolve().parents[3] / "csrc" / "gather_values.c"
_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}


def library_path() -> Path | None:
    """Where the built library for this source lives (None without the source: an installed wheel)."""
    if not SOURCE.is_file():
        return None
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    return native_cache_dir() / f"gather_values-{digest}.so"


def build(quiet: bool = True) -> Path | None:
    """Compile the library if it is not built yet; its path, or None where it cannot be built."""
    target = library_path()
    if target is None:
        return None
    if target.is_file():
        return target
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.info("no C compiler found: host values are gathered by the Python twin (set CC to build %s)", SOURCE)
        return None
    if not compile_into(target, [compiler, "-O2", "-shared", "-fPIC"], [str(SOURCE)], SOURCE):
        return None
    if not quiet:
        log.info("built %s", target)
    return target


def gather_library() -> ctypes.CDLL | None:
    """The loaded library (built on first use), or None: disabled, no compiler, or no source."""
    if os.environ.get("OVERLAPCKPT_NATIVE", "1") == "0":
        return None
    with _lock:
        key = str(library_path())
        if key not in _loaded:
            path = build()
            library = None
            if path is not None:
                try:
                    # PyDLL, not CDLL: the call keeps the GIL. It lasts microseconds, and a CDLL
                    # call releases the GIL and must win it back, which waits for any other
                    # Python thread for up to the switch interval (5 ms) inside optimizer.step().
                    library = ctypes.PyDLL(str(path))
                    library.overlapckpt_gather_values.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_void_p]
                    library.overlapckpt_gather_values.restype = None
                except (OSError, AttributeError) as e:
                    log.warning("loading %s failed (%s); the Python twin is used", path, e)
                    library = None
            _loaded[key] = library
        return _loaded[key]

