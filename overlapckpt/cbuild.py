"""Compiling the optional native helpers (``csrc/``) into the user's cache: shared by the training side and the writer.

Each helper is compiled once per source version, compiler and flags (and, for the torch
extension, per torch and Python) into ``$XDG_CACHE_HOME/overlapckpt`` (else
``~/.cache/overlapckpt``), under a name made of their hash. ``make install`` builds them
ahead; where no compiler exists, each helper's Python twin runs. Imports neither side.

A library in the cache runs inside this process, so the cache is a trust boundary
(``$XDG_CACHE_HOME`` may be ``/tmp``, whose names anyone can take):

- the cache directory must be this user's own, ``0700``, not a symlink, writable by nobody
  else (``format/private_files.py``); otherwise nothing is built or loaded from it, and the
  twins run, with a warning naming it;
- beside each library, a record (``<library>.sha256``, ``0600``) of its size and SHA-256,
  written when it is built; a library is loaded only when it is a regular file of this
  user's that matches its record. A truncated file (whose ``dlopen`` would die of SIGBUS)
  or a swapped one is rebuilt instead, and never loaded;
- the compiler (its resolved path and ``--version``) and every flag are in the name, so a
  library built with other flags (``fused_adam_cuda`` needs ``-ffp-contract=off`` for exact
  results) is never reused.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import logging
import os
import shutil
import stat
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .errors import UntrustedPathError
from .format.private_files import RECORD_MAX_BYTES, make_private_dir, read_regular_file, recreate_private_file

log = logging.getLogger("overlapckpt")
RECORD_SUFFIX = ".sha256"


def native_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "overlapckpt"


def usable_cache_dir() -> Path | None:
    """The cache directory, made ``0700`` or checked as this user's own; None (warned of once) where it is not."""
    path = native_cache_dir()
    try:
        make_private_dir(str(path), "the native helpers' cache", "set XDG_CACHE_HOME to a directory of your own, or remove that one")
    except UntrustedPathError as e:
        _warn_once(f"{e}; the Python twins run")
        return None
    except OSError as e:
        _warn_once(f"the native helpers' cache {path} cannot be made ({e}); the Python twins run")
        return None
    return path


@functools.lru_cache(maxsize=16)
def _warn_once(message: str) -> None:
    log.warning("%s", message)


@functools.lru_cache(maxsize=8)
def compiler_identity(compiler: str) -> str:
    """What names a compiler in a library's key: its resolved path and the first line of its ``--version``."""
    resolved = shutil.which(compiler) or compiler
    try:
        done = subprocess.run([resolved, "--version"], capture_output=True, text=True, timeout=60)
        version = (done.stdout or done.stderr).splitlines()[0] if (done.stdout or done.stderr) else ""
    except (OSError, subprocess.SubprocessError):
        version = "?"
    return f"{os.path.realpath(resolved)}|{version}"


def _digest_of_file(path: Path) -> tuple[int, str]:
    digest = hashlib.sha256()
    nbytes = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
            nbytes += len(chunk)
    return nbytes, digest.hexdigest()


def record_built(target: Path) -> None:
    """Write ``target``'s size and SHA-256 beside it (``0600``): what :func:`verified_library` checks before a load."""
    nbytes, sha256 = _digest_of_file(target)
    record = Path(f"{target}{RECORD_SUFFIX}")
    partial = Path(f"{record}.partial-{os.getpid()}")
    with os.fdopen(recreate_private_file(str(partial)), "w") as f:
        json.dump({"nbytes": nbytes, "sha256": sha256}, f)
    os.replace(partial, record)


def verified_library(target: Path) -> str | None:
    """Why ``target`` must not be loaded, or None when it may: this user's regular file, matching its record.

    FileNotFoundError when it does not exist (not built yet).
    """
    st = os.lstat(target)
    if not stat.S_ISREG(st.st_mode):
        return f"{target} is not a regular file"
    if st.st_uid != os.geteuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{target} is owned by uid {st.st_uid} or writable by others"
    try:
        record = json.loads(read_regular_file(f"{target}{RECORD_SUFFIX}", RECORD_MAX_BYTES))
        nbytes, sha256 = int(record["nbytes"]), str(record["sha256"])
    except FileNotFoundError:
        return f"{target} has no record of its size and SHA-256 (an older overlapckpt built it, or it was planted)"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{target}'s record {target}{RECORD_SUFFIX} is unreadable ({e})"
    if st.st_size != nbytes:
        return f"{target} holds {st.st_size} bytes, and was built with {nbytes} (truncated or replaced)"
    if _digest_of_file(target)[1] != sha256:
        return f"{target}'s SHA-256 is not the one it was built with (replaced)"
    return None


def reuse_or_remove(target: Path) -> bool:
    """Whether the library ``target`` is built and may be loaded; one that may not is removed (and rebuilt by the caller)."""
    try:
        refusal = verified_library(target)
    except FileNotFoundError:
        return False
    if refusal is None:
        return True
    log.warning("%s: removed, and built again", refusal)
    for path in (target, Path(f"{target}{RECORD_SUFFIX}")):
        try:
            path.unlink()
        except FileNotFoundError:
            pass
    return False


def compile_into(target: Path, compiler_and_flags: list[str], inputs_and_libraries: list[str], source: Path) -> bool:
    """Run ``compiler_and_flags -o PARTIAL inputs_and_libraries`` and rename PARTIAL to ``target``.

    Built under a temporary name and renamed: a concurrent build (two ranks) never loads
    half a file. A failure is logged with the compiler's last words, and the twin runs.
    """
    fd, partial = tempfile.mkstemp(prefix=target.name, suffix=".partial", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([*compiler_and_flags, "-o", partial, *inputs_and_libraries], capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            log.warning("building %s failed (%s); the Python twin is used: %s", source, compiler_and_flags[0], done.stderr.strip()[-500:])
            return False
        os.chmod(partial, 0o700)
        os.replace(partial, target)
        record_built(target)
        return True
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("building %s failed (%s); the Python twin is used", source, e)
        return False
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def c_compiler() -> str | None:
    """``$CC``, else ``cc`` or ``gcc`` on the PATH, else None."""
    return os.environ.get("CC") or _compiler_on_path()


@functools.lru_cache(maxsize=1)
def _compiler_on_path() -> str | None:
    # Looked up once: NativeLibrary.get names its library on every call (replay calls it per tensor).
    return shutil.which("cc") or shutil.which("gcc")


def c_library_path(source: Path, stem: str, flags: list[str], libraries: list[str]) -> Path | None:
    """Where the C library built from ``source`` with this compiler and these flags lives, named by their hash.

    None without the source (an installed wheel) or without a compiler. Whether the cache may
    be used is checked where a library is built or reused (:func:`build_c_library`), not here:
    ``NativeLibrary.get`` names its library on every call.
    """
    compiler = c_compiler()
    if not source.is_file() or compiler is None:
        return None
    key = hashlib.sha256(source.read_bytes())
    key.update(json.dumps([compiler_identity(compiler), flags, libraries]).encode())
    return native_cache_dir() / f"{stem}-{key.hexdigest()[:16]}.so"


def build_c_library(source: Path, stem: str, flags: list[str], libraries: list[str], without_it: str, quiet: bool = True) -> Path | None:
    """Compile ``source`` with ``$CC`` (else ``cc`` or ``gcc``) ``-shared -fPIC`` and ``flags`` if it is not built yet.

    Its path, or None where it cannot be built; ``without_it`` says what runs instead, in the log line.
    """
    compiler = c_compiler()
    if compiler is None:
        log.info("no C compiler found: %s (set CC to build %s)", without_it, source)
        return None
    target = c_library_path(source, stem, flags, libraries)
    if target is None or usable_cache_dir() is None:  # the cache is this user's own, or nothing is built or loaded
        return None
    if reuse_or_remove(target):
        return target
    if not compile_into(target, [compiler, *flags, "-shared", "-fPIC"], [str(source), *libraries], source):
        return None
    if not quiet:
        log.info("built %s", target)
    return target


def verified_library_or_missing(target: Path) -> str | None:
    """:func:`verified_library`, with a missing file as a refusal: the check right before a load."""
    try:
        return verified_library(target)
    except FileNotFoundError:
        return f"{target} is missing"


class NativeLibrary:
    """One optional C helper's loaded library: built on first use and loaded once per source version.

    ``get()`` is None where ``OVERLAPCKPT_NATIVE=0``, no compiler or no source exists, or loading
    failed (logged with ``without_it``, what runs instead). ``loader`` is ``ctypes.PyDLL`` for a
    call of microseconds that keeps the GIL, ``ctypes.CDLL`` for a long one that releases it.
    """

    def __init__(
        self, path: Callable[[], Path | None], build: Callable[[], Path | None], loader: type[ctypes.CDLL],
        functions: dict[str, list[Any]], without_it: str,
    ) -> None:
        self._path, self._build, self._loader = path, build, loader
        self._functions, self._without_it = functions, without_it  # each function's argument types
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
                refusal = None if built is None else verified_library_or_missing(built)
                if refusal is not None:
                    log.warning("%s: not loaded; %s", refusal, self._without_it)
                    built = None
                if built is not None:
                    try:
                        library = self._loader(str(built))
                        for name, argtypes in self._functions.items():
                            function = getattr(library, name)
                            function.argtypes = argtypes
                            function.restype = None
                    except (OSError, AttributeError) as e:
                        log.warning("loading %s failed (%s); %s", built, e, self._without_it)
                        library = None
                self._loaded[key] = library
            return self._loaded[key]
