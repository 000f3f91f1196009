"""The training side of the landing page: a pipelined snapshot's landed bytes, published as its copy goes.

The page and its words are described in ``landing_page.py`` (shared with the writer). The
slot pool owns one page per training process, made at the first pipelined snapshot and
mapped by the writer like a host slot. One snapshot at a time uses it: a snapshot is
pipelined only when no other is in flight, so the writer has finished reading the page
for the one before.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...hostbuf import SharedHostBuffer
from ...landing_page import (
    ABANDONED,
    ALL_LANDED,
    COPIED_BYTES,
    COPY_NS,
    LANDED,
    LANDED_AFTER_REQUEST_NS,
    PAGE_BYTES,
    REQUEST,
    LandingWords,
)


@dataclass(frozen=True)
class LandedFigures:
    """A pipelined snapshot's copy, once done: what its stats and ledger record."""

    copy_s: float
    copied_nbytes: int
    landed_after_request_s: float  # when the last copy landed, after the request


class OwnedLandingPage:
    """The page in this process's shared memory, its descriptor handed to the writer."""

    def __init__(self, buffer_id: int) -> None:
        self.buffer_id = buffer_id
        self.buffer = SharedHostBuffer(PAGE_BYTES, pin=None)
        self.buffer.tensor.zero_()
        self._words = LandingWords(self.buffer.tensor.data_ptr())

    def open(self, request_id: int) -> None:
        """Before the request is sent: nothing of it has landed."""
        self._words.write(LANDED, 0)
        self._words.write(REQUEST, request_id)

    def publish(self, landed_nbytes: int) -> None:
        """The slot's first ``landed_nbytes`` bytes hold the snapshot (after the copies that wrote them)."""
        self._words.write(LANDED, landed_nbytes)

    def finish(self, figures: LandedFigures) -> None:
        """Every copy landed: the figures first, then the word the writer waits on."""
        self._words.write(COPY_NS, round(figures.copy_s * 1e9))
        self._words.write(COPIED_BYTES, figures.copied_nbytes)
        self._words.write(LANDED_AFTER_REQUEST_NS, round(figures.landed_after_request_s * 1e9))
        self._words.write(LANDED, ALL_LANDED)

    def abandon(self) -> None:
        """The copy failed: the writer refuses the checkpoint instead of waiting for bytes that never come."""
        self._words.write(LANDED, ABANDONED)

    def release(self) -> None:
        self.buffer.release()
