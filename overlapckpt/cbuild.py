"""Compiling the optional native helpers (``csrc/``) into the user's cache: shared by the training side and the writer.

Each helper is compiled once per source version (and, for the torch extension, per torch and
Python) into ``$XDG_CACHE_HOME/overlapckpt`` (else ``~/.cache/overlapckpt``), under a name made
of the source's hash. ``make install`` builds them ahead; where no compiler exists, each
helper's Python twin runs. Imports neither side.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger("overlapckpt")


def native_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "overlapckpt"


def compile_into(target: Path, compiler_and_flags: list[str], inputs_and_libraries: list[str], source: Path) -> bool:
    """Run ``compiler_and_flags -o PARTIAL inputs_and_libraries`` and rename PARTIAL to ``target``.

    Built under a temporary name and renamed: a concurrent build (two ranks) never loads
    half a file. A failure is logged with the compiler's last words, and the twin runs.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(prefix=target.name, suffix=".partial", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([*compiler_and_flags, "-o", partial, *inputs_and_libraries], capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            log.warning("building %s failed (%s); the Python twin is used: %s", source, compiler_and_flags[0], done.stderr.strip()[-500:])
            return False
        os.replace(partial, target)
        return True
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("building %s failed (%s); the Python twin is used", source, e)
        return False
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def c_library_path(source: Path, stem: str) -> Path | None:
    """Where the built C library for this ``source`` lives, named by its hash (None without the source: an installed wheel)."""
    if not source.is_file():
        return None
    digest = hashlib.sha256(source.read_bytes()).hexdigest()[:16]
    return native_cache_dir() / f"{stem}-{digest}.so"


def build_c_library(source: Path, stem: str, flags: list[str], libraries: list[str], without_it: str, quiet: bool = True) -> Path | None:
    """Compile ``source`` with ``$CC`` (else ``cc`` or ``gcc``) ``-shared -fPIC`` and ``flags`` if it is not built yet.

    Its path, or None where it cannot be built; ``without_it`` says what runs instead, in the log line.
    """
    target = c_library_path(source, stem)
    if target is None:
        return None
    if target.is_file():
        return target
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.info("no C compiler found: %s (set CC to build %s)", without_it, source)
        return None
    if not compile_into(target, [compiler, *flags, "-shared", "-fPIC"], [str(source), *libraries], source):
        return None
    if not quiet:
        log.info("built %s", target)
    return target


class NativeLibrary:
    """One optional C helper's loaded library: built on first use and loaded once per source version.

    ``get()`` is None where ``OVERLAPCKPT_NATIVE=0``, no compiler or no source exists, or loading
    failed (logged with ``without_it``, what runs instead). ``loader`` is ``ctypes.PyDLL`` for a
    call of microseconds that keeps the GIL, ``ctypes.CDLL`` for a long one that releases it.
    """

    def __init__(
        self, path: Callable[[], Path | None], build: Callable[[], Path | None], loader: type[ctypes.CDLL],
        function: str, argtypes: list[Any], without_it: str,
    ) -> None:
        self._path, self._build, self._loader = path, build, loader
        self._function, self._argtypes, self._without_it = function, argtypes, without_it
        self._lock = threading.Lock()
        self._loaded: dict[str, ctypes.CDLL | None] = {}

    def get(self) -> ctypes.CDLL | None:
        if os.environ.get("OVERLAPCKPT_NATIVE", "1") == "0":
            return None
        with self._lock:
            key = str(self._path())
            if key not in self._loaded:
                built = self._build()
                library = None
                if built is not None:
                    try:
                        library = self._loader(str(built))
                        function = getattr(library, self._function)
                        function.argtypes = self._argtypes
                        function.restype = None
                    except (OSError, AttributeError) as e:
                        log.warning("loading %s failed (%s); %s", built, e, self._without_it)
                        library = None
                self._loaded[key] = library
            return self._loaded[key]
