"""Compiling the optional native helpers (``csrc/``) into the user's cache: shared by the training side and the writer.

Each helper is compiled once per source version (and, for the torch extension, per torch and
Python) into ``$XDG_CACHE_HOME/overlapckpt`` (else ``~/.cache/overlapckpt``), under a name made
of the source's hash. ``make install`` builds them ahead; where no compiler exists, each
helper's Python twin runs. Imports neither side.
"""

from __future__ import annotations

import logging
import os
import subprocess
import tempfile
from pathlib import Path

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
