"""What a file's bytes parsed to, kept for the next read of the very same bytes: one load reads some files twice.

Runs in the process that loads. A load resolves its checkpoint by reading the manifest, then
reads it again for its checks; a verified load of a large state reads ``.metadata`` in its check
pass and again in its placing pass. At 30,000 tensors each parse takes about half a second.
The bytes are read from storage each time and keyed by their length and SHA-256, so a file
that changed in between is parsed afresh: only identical bytes share a parse. A few entries
are kept (each holds a parsed record of its checkpoint); a failed parse is never kept.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

Parsed = TypeVar("Parsed")


class RecentParses(Generic[Parsed]):
    """The last ``entries`` parses, by (the caller's key, the bytes' length, their SHA-256)."""

    def __init__(self, entries: int) -> None:
        self.entries = entries
        self._lock = threading.Lock()
        self._parsed: OrderedDict[tuple[Hashable, int, bytes], Parsed] = OrderedDict()

    def parsed(self, key: Hashable, data: bytes, parse: Callable[[], Parsed]) -> Parsed:
        """What ``parse()`` made of ``data`` under ``key``: from an earlier call with the same bytes, else parsed now."""
        digest = (key, len(data), hashlib.sha256(data).digest())
        with self._lock:
            found = self._parsed.get(digest)
            if found is not None:
                self._parsed.move_to_end(digest)
                return found
        value = parse()  # outside the lock: another thread's parse of other bytes goes on meanwhile
        with self._lock:
            self._parsed[digest] = value
            while len(self._parsed) > self.entries:
                self._parsed.popitem(last=False)
        return value
