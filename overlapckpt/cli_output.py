"""What the command line prints: sizes and times in readable units, text escaped for a terminal, a progress line.

Separate from ``cli.py``, which parses the commands and runs them: everything here only
formats and writes, and a crafted manifest's text passes through ``printable`` on its way out.
"""

from __future__ import annotations

import datetime
import sys
from typing import Any


def readable_size(nbytes: int) -> str:
    """``nbytes`` in B, KiB, MiB or GiB, one decimal above bytes (``1.5 MiB``)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024  # type: ignore[assignment]
    return str(nbytes)


def utc_time(unix_s: float) -> str:
    """A Unix time as ``YYYY-MM-DD HH:MM:SS UTC``."""
    return datetime.datetime.fromtimestamp(unix_s, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def printable(text: str) -> str:
    """``text`` with every character a terminal would act on escaped (``\x1b``, ``\n``, ...).

    What a manifest holds is data from storage: a crafted name or field must not move the
    cursor, clear the screen or forge a line of output.
    """
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def say(text: str, file: Any = None) -> None:
    """Print ``text``, escaped by ``printable``, to ``file`` (stdout by default)."""
    print(printable(text), file=file if file is not None else sys.stdout)


class Progress:
    """One line on stderr, rewritten in place, when stderr is a terminal; nothing otherwise (logs, pipes, CI)."""

    def __init__(self) -> None:
        self.shown = sys.stderr.isatty()
        self._last = ""

    def say(self, text: str) -> None:
        if self.shown and text != self._last:
            self._last = text
            sys.stderr.write("\r\033[K" + printable(text))
            sys.stderr.flush()

    def bytes_read(self, what: str) -> Any:
        return lambda done, total: self.say(f"{what}: {readable_size(done)} of {readable_size(total)} ({100 * done // max(total, 1)}%)")

    def done(self) -> None:
        if self.shown and self._last:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()
            self._last = ""
