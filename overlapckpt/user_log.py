"""The lines a user sees without configuring logging: one when a run resumes (or starts fresh), one at close.

Everything the library logs goes through ``logging.getLogger("overlapckpt")`` and its
children. As transformers and Lightning do, that logger gets a handler of its own at
import, so a script that configures no logging still sees what it must know: which
checkpoint a restart resumed, from which tier, after how long; and at close, how many
checkpoints committed and what they cost the loop. Those lines go to the
``overlapckpt.summary`` logger, at INFO, which is on by default; the rest stays at
Python's default (warnings and errors only).

The handler writes only while the root logger has no handler: once a script configures
logging (``logging.basicConfig``, a framework's set-up, pytest's capture), records go
there alone, never twice. ``overlapckpt.set_verbosity(logging.WARNING)`` silences the
summary lines; ``set_verbosity(logging.INFO)`` shows every commit too.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Sequence
from typing import Any

LIBRARY_LOGGER = "overlapckpt"
SUMMARY_LOGGER = "overlapckpt.summary"
summary = logging.getLogger(SUMMARY_LOGGER)


class _WhileLoggingIsUnconfigured(logging.Filter):
    """Pass a record only while the root logger has no handler (the script configured no logging)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not logging.getLogger().handlers


class _DefaultHandler(logging.StreamHandler):  # type: ignore[type-arg,unused-ignore]
    """The library's own stderr handler (one per process, however often the package is imported)."""


def install_default_handler() -> None:
    """Give the ``overlapckpt`` logger its stderr handler, and the summary lines their INFO level (unless set)."""
    library = logging.getLogger(LIBRARY_LOGGER)
    if not any(isinstance(h, _DefaultHandler) for h in library.handlers):
        handler = _DefaultHandler()
        handler.setFormatter(logging.Formatter("overlapckpt: %(message)s"))
        handler.addFilter(_WhileLoggingIsUnconfigured())
        library.addHandler(handler)
    if summary.level == logging.NOTSET:
        summary.setLevel(logging.INFO)


def set_verbosity(level: int) -> None:
    """The level of everything overlapckpt logs: ``logging.WARNING`` silences the resume and close lines.

    ``logging.INFO`` also shows each commit (step, bytes, copy and commit times) and each
    retention; ``logging.DEBUG`` the writer's and the restore's details.
    """
    logging.getLogger(LIBRARY_LOGGER).setLevel(level)
    summary.setLevel(level)


def say_resumed(path: str, step: int, source: str, seconds: float | None) -> None:
    """One line: the checkpoint a run resumed, its version, the tier it came from, how long it took (None: the framework's load)."""
    took = "" if seconds is None else f" in {seconds:.2f} s"
    summary.info("resumed %s (version %d) from the %s%s", path, step, source, took)


def say_fresh(root: str, local_dir: str | None = None) -> None:
    """One line: nothing to resume, so the run starts from its initial state."""
    summary.info("no checkpoint under %s%s yet: starting fresh", root, "" if local_dir is None else f" or {local_dir}")


def say_closed(root: str, stats: Sequence[dict[str, Any]]) -> None:
    """One line at close: checkpoints committed (steps), and the loop's blocked time per checkpoint (median, worst)."""
    committed = [s for s in stats if s.get("committed_at_unix_s") is not None]
    if not committed:
        summary.info("closed %s: no checkpoint committed", root)
        return
    blocked_ms = [1e3 * (s.get("hook_host_s", 0.0) + s.get("waited_for_slot_s", 0.0)) for s in committed]
    steps = [s["step"] for s in committed]
    summary.info(
        "closed %s: %d checkpoint(s) committed (steps %s), the loop blocked %.2f ms per checkpoint (median; worst %.2f ms)",
        root,
        len(committed),
        ", ".join(map(str, steps)) if len(steps) <= 6 else f"{steps[0]} ... {steps[-1]}",
        statistics.median(blocked_ms),
        max(blocked_ms),
    )
