"""The writers' values in the job's key-value store, sealed with a key only this run's ranks hold.

torch.distributed's TCPStore trusts every client: whoever reaches it can list the keys
(``list_keys``), so the writers' random prefix is no secret, and can write any value.
Before this seal, a client that wrote ``count/N = "xyz"`` made the store server drop
the next writer's connection on ``add`` (both ranks exited 1), and one that wrote
``preempt/signal = "9"`` made every rank try to exit with SIGKILL.

Every value the writers write is therefore ``HMAC-SHA256(key, name + value)`` in hex,
then the value. The key is drawn on training rank 0 at construction and shared over
the training process group only (``train/run/distributed.py``); it reaches each writer over
its local socket pair. The MAC covers the key's full name, so a sealed value copied to
another key does not open either. A value that does not open is *forged*: the callers
treat it as absent (a signal, a step, a marker) or as a named refusal (a claim), never
as a crash.

Counters use ``compare_set`` on sealed values instead of ``add``: ``add`` on a value a
client replaced with text breaks the connection for good. Each counter value carries
a random nonce, so that two writers that increment from the same value never both
believe they won.

What the seal cannot stop: a client may delete keys, or overwrite a sealed value with a
forged one, which makes that checkpoint fail (a named refusal) or a preemption go
unnoticed through the store (the signalled rank still agrees with its own signal).
"""

from __future__ import annotations

import hmac
import secrets
from datetime import timedelta
from hashlib import sha256
from typing import Any

from ..errors import ForgedStoreValueError

_MAC_HEX = 64  # SHA-256 in hex
# Reads of a counter that another writer changed between our read and our compare_set:
# a handful at most (one replacement writer at a time); the bound only stops a loop.
_MAX_INCREMENT_TRIES = 1000
# What read_raw expects a key to hold (never a sealed value's hex MAC), a random suffix after it.
_ABSENT_MARK = "\0absent:"
# How long read_posted lets the store answer keys a wait has just seen posted, before it reads
# them one by one instead: the store answers at once unless another client deleted one since.
POSTED_READ_TIMEOUT = timedelta(seconds=2)


class SealedStore:
    """A torch.distributed store whose values this run's writers seal, under ``namespace`` (the prefix the store adds)."""

    def __init__(self, store: Any, key: bytes, namespace: str) -> None:
        if len(key) < 16:
            raise ValueError(f"a store sealing key of {len(key)} bytes is too short; draw one with protocol.new_store_key()")
        self.store = store
        self._key = key
        self.namespace = namespace

    def _mac(self, name: str, value: str) -> str:
        message = f"{self.namespace}{name}".encode() + b"\0" + value.encode("utf-8")
        return hmac.new(self._key, message, sha256).hexdigest()

    def seal(self, name: str, value: str) -> str:
        """What ``set`` stores under ``name`` for ``value``."""
        return self._mac(name, value) + value

    def open(self, name: str, raw: bytes) -> str | None:
        """The value ``raw`` (as read from ``name``) was sealed with, or None if it is forged."""
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            return None
        mac, value = text[:_MAC_HEX], text[_MAC_HEX:]
        if len(mac) != _MAC_HEX or not hmac.compare_digest(mac, self._mac(name, value)):
            return None
        return value

    def set(self, name: str, value: str) -> None:
        self.store.set(name, self.seal(name, value))

    def read_raw(self, name: str) -> bytes | None:
        """The bytes stored under ``name``, or None if there is no such key; one request, which never waits.

        The store's own ``get`` waits for a missing key until the store's timeout, so a
        ``check`` then a ``get`` stalls when another client deletes the key between the two
        (the preemption watch stalled so for longer than the grace period). ``compare_set``
        with a fresh random expected value, on a key that holds anything else, changes
        nothing and answers what is there; on a missing key it creates nothing and answers
        the expected value back, which no sealed value (64 hex digits first) can equal.
        """
        absent = _ABSENT_MARK + secrets.token_hex(16)
        raw = bytes(self.store.compare_set(name, absent, absent))
        return None if raw == absent.encode() else raw

    def read_posted(self, names: list[str]) -> list[bytes | None]:
        """The bytes under each of ``names``, which a ``wait`` has just seen posted (None where one is gone since); one request.

        ``multi_get`` reads them all in one round trip, but waits for any missing key until
        the client's timeout: a key another client deleted after the wait would hold it
        that long. The client's timeout is cut to ``POSTED_READ_TIMEOUT`` for this one call
        (this writer's thread is the client's only user; the preemption watch has its
        own) and put back after; if the store does not answer within it, each key is read
        on its own by ``read_raw``, which never waits, to say which are gone.
        """
        multi_get = getattr(self.store, "multi_get", None)
        previous = getattr(self.store, "timeout", None)
        if multi_get is None or not isinstance(previous, timedelta) or not names:
            return [self.read_raw(name) for name in names]
        self.store.set_timeout(POSTED_READ_TIMEOUT)
        try:
            # An empty answer is a key deleted since (a store's server answers a missing key so
            # inside multi_get): absent, as read_raw would say; no sealed value is empty.
            return [bytes(raw) or None for raw in multi_get(names)]
        except Exception:  # noqa: BLE001 - the store's timeout error type differs between torch releases
            return [self.read_raw(name) for name in names]
        finally:
            self.store.set_timeout(previous)

    def get(self, name: str) -> str | None:
        """The value under ``name``, or None if it is absent or forged (``read_raw`` tells which); never waits."""
        raw = self.read_raw(name)
        return None if raw is None else self.open(name, raw)

    def check(self, names: list[str]) -> bool:
        return bool(self.store.check(names))

    def wait(self, names: list[str], timeout: timedelta) -> None:
        self.store.wait(names, timeout)

    def delete_key(self, name: str) -> bool:
        return bool(self.store.delete_key(name))

    def read_counter(self, name: str) -> int | None:
        """The counter under ``name`` (0 if never set), or None if its value is forged."""
        raw = self.read_raw(name)
        if raw is None:
            return 0
        value = self.open(name, raw)
        return None if value is None else _counter_value(value)

    def increment(self, name: str, by: int) -> int:
        """Add ``by`` to the counter under ``name`` atomically; its new value. ForgedStoreValueError if it is forged."""
        raw = bytes(self.store.compare_set(name, "", self.seal(name, f"0:{secrets.token_hex(8)}")))
        for _ in range(_MAX_INCREMENT_TRIES):
            value = self.open(name, raw)
            current = None if value is None else _counter_value(value)
            if current is None:
                raise ForgedStoreValueError(
                    f"the writers' counter {self.namespace}{name} in the job's store holds a value this run's writers did "
                    "not write (another client of the store wrote it); the writers cannot agree on their group through it. "
                    "Run the job on a network where only its own processes reach the store"
                )
            if by == 0:
                return current
            desired = self.seal(name, f"{current + by}:{secrets.token_hex(8)}")
            got = bytes(self.store.compare_set(name, raw, desired))
            if got == desired.encode():
                return current + by
            raw = got  # another writer moved it first: add to its value
        raise ForgedStoreValueError(f"the writers' counter {self.namespace}{name} kept changing under {_MAX_INCREMENT_TRIES} increments")


def _counter_value(value: str) -> int | None:
    count, _, _nonce = value.partition(":")
    return int(count) if count.isdigit() else None
