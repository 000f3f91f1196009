"""Unique attempts: an attempt never writes where another attempt, or a committed checkpoint, is.

**Local disk.** Each attempt writes into a directory of its own,
``<root>/<name>.attempt-<run8>-<random8>``, which no other attempt and no other job
ever names. DCP commits ``.metadata`` there (the manifest first, as everywhere), and
the coordinator then publishes the whole directory with one ``rename`` to
``<root>/<name>``. The rename is atomic, and the kernel refuses it when ``<name>``
already exists with content, so a committed checkpoint is never replaced, and no
two attempts ever open the same file: a second job can neither truncate a committed
shard nor delete an attempt in progress.

**Object stores** have no rename of a prefix (a copy would move every byte twice),
so an attempt writes in place, but only after claiming the checkpoint's prefix with
``<name>/.overlapckpt-attempt``, created by a conditional PUT (``If-None-Match: *``).
The claim is taken *before* the committed check, and released after the commit, so
of two attempts on one name exactly one writes and the other sees either the claim
or the commit. An existing claim is taken over only when it is provably dead:
this run's own (a writer that was killed and restarted; one coordinator per run), or,
while this run holds the root's lease (``lease.py``), another run's: the lease says
no other job writes this root.

**Debris.** A killed attempt leaves its directory (or claimed prefix). The
coordinator's next attempt removes this run's dead attempts, and, while it holds the
root's lease, every other run's too.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import posixpath
import re
import secrets
import socket
from dataclasses import dataclass

from ..errors import CheckpointExistsError
from .manifest import step_of_name
from .private_files import narrow_tree
from .storage import CheckpointStore

ATTEMPT_MARK = ".attempt-"
CLAIM_NAME = ".overlapckpt-attempt"
_ATTEMPT_RE = re.compile(r"((?:step|checkpoint)-[0-9]+(?:-[0-9a-f]{8})?)\.attempt-([0-9a-f]{8})-([0-9a-f]{8})", re.ASCII)
# A checkpoint directory retention retired (CheckpointStore.retire_checkpoint): the run's tag in group 1.
_RETIRED_RE = re.compile(r"\.retired-(?:step|checkpoint)-.+-([0-9a-z]+)-[0-9a-f]{8}")
log = logging.getLogger("overlapckpt.attempts")


def already_committed(store: CheckpointStore, name: str) -> CheckpointExistsError:
    """The one refusal to write over a committed checkpoint."""
    return CheckpointExistsError(
        f"checkpoint {store.checkpoint_url(name)} is already committed; overlapckpt never "
        "overwrites a committed checkpoint: use a new path, or delete it first"
    )


def new_attempt_id(run_id: str) -> str:
    """An attempt's id: this run's first 8 hex digits, then 8 random ones."""
    return f"{run_id[:8]}-{secrets.token_hex(4)}"


@dataclass(frozen=True)
class Attempt:
    """One attempt at writing checkpoint ``name`` of run ``run_id``."""

    store: CheckpointStore
    name: str
    run_id: str
    attempt_id: str
    root_leased: bool = False  # this run holds the root's lease: other runs' leftovers are dead

    @property
    def directory(self) -> str:
        """Where DCP writes, relative to the root."""
        if self.store.is_local:
            return f"{self.name}{ATTEMPT_MARK}{self.attempt_id}"
        return self.name

    # ---- the coordinator's side: begin, publish, abandon ------------------------

    def begin(self) -> None:
        """Make the attempt's place; CheckpointExistsError if ``name`` is committed or claimed by a live attempt."""
        self._sweep_dead_attempts()
        if self.store.is_local:
            os.makedirs(self.store.checkpoint_url(self.directory), exist_ok=False)
        else:
            self._claim()
        if self.store.is_committed(self.name):  # after the claim: a commit before it is seen here
            self.abandon()
            raise self._exists()

    def publish(self) -> None:
        """The commit, once DCP has committed ``.metadata`` in the attempt's place."""
        if not self.store.is_local:
            self._release_claim()
            return
        source = self.store.checkpoint_url(self.directory)
        target = self.store.checkpoint_url(self.name)
        if self.store.private:
            narrow_tree(source)  # a node-local tier's files: 0600 before they are published (private_files.py)
        try:
            self._rename_into_place(source, target)
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST) or self.store.is_committed(self.name):
                raise
            # A directory at the name without .metadata: a retention removal cut short, or
            # what an older overlapckpt left. Nothing commits there but a rename, so it goes.
            self.store.remove_tree(self.name)
            self._rename_into_place(source, target)
        try:
            _fsync_directory(self.store.root_path)  # the rename itself survives a power cut
        except OSError as e:
            log.warning("checkpoint %s committed, but syncing %s failed: %s", target, self.store.root_path, e)

    def _rename_into_place(self, source: str, target: str) -> None:
        try:
            os.rename(source, target)  # refused by the kernel if target has content: never replaces a commit
        except OSError as e:
            if e.errno in (errno.ENOTEMPTY, errno.EEXIST) and self.store.is_committed(self.name):
                raise self._exists() from e
            raise

    def abandon(self) -> None:
        """Remove everything this attempt wrote (never what another attempt or a commit owns)."""
        if self.store.is_local:
            self.store.remove_tree(self.directory)
            return
        if self._claim_holder() != self.attempt_id:
            return
        if not self.store.is_committed(self.name):
            self.store.remove_tree(self.name)
        else:
            self._release_claim()

    # ---- helpers ------------------------------------------------------------------

    def _exists(self) -> CheckpointExistsError:
        return already_committed(self.store, self.name)

    def _claim_record(self) -> bytes:
        return json.dumps(
            {"attempt": self.attempt_id, "run_id": self.run_id, "pid": os.getpid(), "host": socket.gethostname()}, sort_keys=True
        ).encode()

    def _claim_path(self) -> str:
        return posixpath.join(self.name, CLAIM_NAME)

    def _claim(self) -> None:
        for _ in range(2):  # a second try only after removing a dead claim
            try:
                self.store.create_exclusive(self._claim_path(), self._claim_record())
                return
            except FileExistsError:
                holder = self._claim_record_of_holder()
                if self.store.is_committed(self.name):
                    raise self._exists() from None
                if not self._holder_is_dead(holder):
                    who = "an unreadable claim" if holder is None else f"attempt {holder.get('attempt')} of run {holder.get('run_id')}"
                    raise CheckpointExistsError(
                        f"checkpoint {self.store.checkpoint_url(self.name)} is being written by {who}, another job on this "
                        f"root; give each job its own path, or, once that job is gone, delete {self.store.checkpoint_url(self.name)}"
                    ) from None
                log.warning("removing the uncommitted leftovers of %s at %s", _describe(holder), self.store.checkpoint_url(self.name))
                self.store.remove_tree(self.name)
        raise CheckpointExistsError(f"checkpoint {self.store.checkpoint_url(self.name)} was claimed by another attempt at the same time")

    def _holder_is_dead(self, holder: dict[str, object] | None) -> bool:
        if holder is not None and holder.get("run_id") == self.run_id:
            return True  # this run's own: one coordinator per run, so an earlier one that died
        return self.root_leased  # the lease says no other job writes this root

    def _claim_record_of_holder(self) -> dict[str, object] | None:
        try:
            raw = json.loads(self.store.read_bytes(self.name, CLAIM_NAME))
        except (FileNotFoundError, ValueError):
            return None
        return raw if isinstance(raw, dict) else None

    def _claim_holder(self) -> str | None:
        holder = self._claim_record_of_holder()
        return None if holder is None else str(holder.get("attempt"))

    def _release_claim(self) -> None:
        self.store.remove_file(self.name, CLAIM_NAME)

    def _sweep_dead_attempts(self) -> None:
        """Remove dead attempt directories (local) under the root: this run's, and others' under the lease."""
        if not self.store.is_local:
            return  # an object store's leftovers sit at the name, under a claim: taken over by _claim
        try:
            entries = os.listdir(self.store.root_path)
        except FileNotFoundError:
            return
        for entry in entries:
            retired = _RETIRED_RE.fullmatch(entry)
            if retired is not None:  # retention's leftover: a writer died before deleting it
                if retired.group(1) == self.run_id[:8] or self.root_leased:
                    log.info("removing %s, retired by retention and left by a writer that died", self.store.checkpoint_url(entry))
                    self.store.purge_retired(entry)
                continue
            match = _ATTEMPT_RE.fullmatch(entry)
            if match is None or step_of_name(match.group(1)) is None:
                continue
            if match.group(2) == self.run_id[:8] or self.root_leased:
                log.info("removing the dead attempt directory %s", self.store.checkpoint_url(entry))
                self.store.remove_tree(entry)


def _describe(holder: dict[str, object] | None) -> str:
    if holder is None:
        return "an attempt with an unreadable claim"
    return f"attempt {holder.get('attempt')} of run {holder.get('run_id')} (pid {holder.get('pid')} on {holder.get('host')})"


def _fsync_directory(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
