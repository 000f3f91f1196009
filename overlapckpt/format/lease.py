"""One root, one job: a lease file under the root, taken at construction, released at close.

Two jobs writing one root would clear each other's attempts and race on ``latest``.
The first Checkpointer on a root creates ``<root>/.overlapckpt-lease`` exclusively
(``O_EXCL`` on a local disk, a conditional PUT with ``If-None-Match: *`` on S3) with
its pid, host and run id; a second one gets a ``RootLeaseError`` naming the holder.

A lease records its holder's host, boot id, PID namespace and pid
(``process_identity.py``). It is *stale*, and taken over with a warning, when its holder is
provably gone: a process of this host, boot and PID namespace that no longer exists, a
holder from an earlier boot of this host, or a Checkpointer of this process that was closed
without releasing it (it is released at close, so only a crash leaves one). A holder on
another host, or in another PID namespace (a container beside this one), cannot be checked
from here: the error names it and the file to delete once that job is known to be gone.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import dataclass

from ..errors import RootLeaseError
from .private_files import RECORD_MAX_BYTES, read_regular_file, refusal_of_directory
from .process_identity import ProcessIdentity, is_provably_gone, same_process_space, this_process
from .storage import CheckpointStore

LEASE_NAME = ".overlapckpt-lease"
log = logging.getLogger("overlapckpt.lease")

# Run ids of the Checkpointers of this process that hold a lease now.
_HELD_HERE: set[str] = set()


@dataclass(frozen=True)
class LeaseHolder:
    who: ProcessIdentity
    run_id: str
    since_unix_s: float

    @property
    def pid(self) -> int:
        return self.who.pid

    @property
    def host(self) -> str:
        return self.who.host

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.since_unix_s))
        space = "" if same_process_space(self.who) or self.who.host != this_process().host else ", in another PID namespace or boot"
        return f"run {self.run_id} (pid {self.pid} on {self.host}{space}, since {when})"

    def record(self) -> bytes:
        return json.dumps({**self.who.fields(), "run_id": self.run_id, "since_unix_s": self.since_unix_s}, sort_keys=True).encode()

    @classmethod
    def parse(cls, data: bytes) -> LeaseHolder | None:
        """The holder a lease file names, or None when it is not a lease this code wrote."""
        try:
            raw = json.loads(data)
            return cls(who=ProcessIdentity.from_record(raw), run_id=str(raw["run_id"]), since_unix_s=float(raw["since_unix_s"]))
        except (ValueError, KeyError, TypeError):
            return None


def live_holder(store: CheckpointStore) -> LeaseHolder | None:
    """Who holds ``store``'s root now, or None: no lease, or one whose holder is provably gone."""
    holder = RootLease(store, run_id="")._holder()
    if holder is None or is_provably_gone(holder.who):
        return None
    return holder


class RootLease:
    """The lease on ``store``'s root for run ``run_id``."""

    def __init__(self, store: CheckpointStore, run_id: str) -> None:
        self.store = store
        self.me = LeaseHolder(who=this_process(), run_id=run_id, since_unix_s=time.time())
        self.held = False

    @property
    def url(self) -> str:
        return self.store.checkpoint_url(LEASE_NAME)

    def acquire(self) -> None:
        record = self.me.record()
        for _ in range(2):  # a second try only after removing a stale lease
            try:
                self.store.create_exclusive(LEASE_NAME, record)
            except FileExistsError:
                holder = self._holder()
                if holder is not None and self._stale(holder):
                    log.warning("taking over the stale lease on %s of %s, which is gone", self.store.root, holder.describe())
                    self.store.remove_root_file(LEASE_NAME)
                    continue
                who = holder.describe() if holder is not None else "an unreadable lease file"
                raise RootLeaseError(
                    f"checkpoint root {self.store.root!r} is leased by {who}: one root, one job. Give this job its own "
                    f"path, or, once that job is known to be gone, delete {self.url}"
                ) from None
            self.held = True
            _HELD_HERE.add(self.me.run_id)
            return
        raise RootLeaseError(f"could not take the lease on {self.store.root!r}: another job took it at the same time")

    def release(self) -> None:
        """Remove the lease if it is still ours (never another job's)."""
        if not self.held:
            return
        self.held = False
        _HELD_HERE.discard(self.me.run_id)
        try:
            holder = self._holder()
            if holder is not None and holder.run_id == self.me.run_id:
                self.store.remove_root_file(LEASE_NAME)
        except Exception as e:  # closing must go on; the next job sees a stale lease and takes it
            log.warning("could not release the lease %s: %s: %s", self.url, type(e).__name__, e)

    def _holder(self) -> LeaseHolder | None:
        try:
            data = self.store.read_root_file(LEASE_NAME, max_bytes=RECORD_MAX_BYTES)
        except FileNotFoundError:
            return None
        except OSError as e:  # a FIFO, a device, a link or a huge file planted as the lease: not a lease
            log.warning("the lease %s is not a lease file overlapckpt wrote (%s): taken as unreadable", self.url, e)
            return None
        return LeaseHolder.parse(data)

    def _stale(self, holder: LeaseHolder) -> bool:
        if holder.pid == self.me.pid and same_process_space(holder.who):
            return holder.run_id not in _HELD_HERE  # a Checkpointer of this process that is gone
        return is_provably_gone(holder.who)


def sweep_dead_tiers(own_dir: str) -> list[str]:
    """Remove the local-tier directories a dead job of this user left beside ``own_dir``; the ones removed.

    A node-local tier (``format/tiers.py``) holds node memory when it is on tmpfs: a job
    that died leaves it behind. A sibling is removed only when all of these hold:

    - it is a directory (not a symlink) owned by this user, and carries the tier marker
      (``tiers.TIER_MARKER_NAME``), a regular file: a durable root named ``overlapckpt-run1``
      has none, and is never touched;
    - its lease is readable and names a holder that is provably gone (``process_identity.py``):
      a live job's tier, another host's or another PID namespace's, and one without a lease
      (its job closed cleanly and may come back for it) are left alone.
    """
    from .tiers import LOCAL_DIR_PREFIX, TIER_MARKER_NAME

    parent = os.path.dirname(os.path.abspath(own_dir))
    removed: list[str] = []
    try:
        siblings = sorted(os.listdir(parent))
    except OSError:
        return removed
    for name in siblings:
        path = os.path.join(parent, name)
        if not name.startswith(LOCAL_DIR_PREFIX) or path == os.path.abspath(own_dir) or refusal_of_directory(path) is not None:
            continue
        try:  # refusal_of_directory passed: a real directory of this user's, or gone since (the reads fail)
            read_regular_file(os.path.join(path, TIER_MARKER_NAME), RECORD_MAX_BYTES)
            holder = LeaseHolder.parse(read_regular_file(os.path.join(path, LEASE_NAME), RECORD_MAX_BYTES))
        except OSError:
            continue  # no marker: not a tier; no lease, or not a file: its job may come back for it
        if holder is None or holder.run_id in _HELD_HERE or not is_provably_gone(holder.who):
            continue
        shutil.rmtree(path, ignore_errors=True)
        log.warning("removed %s, the local tier of %s, which is gone", path, holder.describe())
        removed.append(path)
    return removed
