"""One root, one job: a lease file under the root, taken at construction, released at close.

Two jobs writing one root would clear each other's attempts and race on ``latest``.
The first Checkpointer on a root creates ``<root>/.overlapckpt-lease`` exclusively
(``O_EXCL`` on a local disk, a conditional PUT with ``If-None-Match: *`` on S3) with
its pid, host and run id; a second one gets a ``RootLeaseError`` naming the holder.

A lease is *stale*, and taken over with a warning, when its holder is provably gone:
a process of this host that no longer exists, or a Checkpointer of this process
that was closed without releasing it (it is released at close, so only a crash
leaves one). A holder on another host cannot be checked from here: the error names
it and the file to delete once that job is known to be gone.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import time
from dataclasses import asdict, dataclass

from ..errors import RootLeaseError
from .storage import CheckpointStore

LEASE_NAME = ".overlapckpt-lease"
log = logging.getLogger("overlapckpt.lease")

# Run ids of the Checkpointers of this process that hold a lease now.
_HELD_HERE: set[str] = set()


@dataclass(frozen=True)
class LeaseHolder:
    pid: int
    host: str
    run_id: str
    since_unix_s: float

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.since_unix_s))
        return f"run {self.run_id} (pid {self.pid} on {self.host}, since {when})"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def live_holder(store: CheckpointStore) -> LeaseHolder | None:
    """Who holds ``store``'s root now, or None: no lease, or one whose holder on this host is gone."""
    holder = RootLease(store, run_id="")._holder()
    if holder is None:
        return None
    if holder.host == socket.gethostname() and not _pid_alive(holder.pid):
        return None
    return holder


class RootLease:
    """The lease on ``store``'s root for run ``run_id``."""

    def __init__(self, store: CheckpointStore, run_id: str) -> None:
        self.store = store
        self.me = LeaseHolder(pid=os.getpid(), host=socket.gethostname(), run_id=run_id, since_unix_s=time.time())
        self.held = False

    @property
    def url(self) -> str:
        return self.store.checkpoint_url(LEASE_NAME)

    def acquire(self) -> None:
        record = json.dumps(asdict(self.me), sort_keys=True).encode()
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
            raw = json.loads(self.store.read_root_file(LEASE_NAME))
            return LeaseHolder(
                pid=int(raw["pid"]), host=str(raw["host"]), run_id=str(raw["run_id"]), since_unix_s=float(raw["since_unix_s"])
            )
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            return None  # gone, or not a lease this code wrote

    def _stale(self, holder: LeaseHolder) -> bool:
        if holder.host != self.me.host:
            return False  # cannot be checked from here
        if holder.pid == self.me.pid:
            return holder.run_id not in _HELD_HERE  # a Checkpointer of this process that is gone
        return not _pid_alive(holder.pid)


def sweep_dead_tiers(own_dir: str) -> list[str]:
    """Remove the local-tier directories a dead job left beside ``own_dir``; the ones removed.

    A node-local tier (``format/tiers.py``) holds node memory when it is on tmpfs: a job
    that died leaves it behind. Under the lease rules, a sibling directory named
    ``overlapckpt-*`` is removed only when its lease names a process of this host that
    no longer exists. A live job's tier, another host's, one without a lease (its job
    closed cleanly and may come back for it) and anything not ours are left alone.
    """
    from .tiers import LOCAL_DIR_PREFIX

    parent = os.path.dirname(os.path.abspath(own_dir))
    removed: list[str] = []
    try:
        siblings = sorted(os.listdir(parent))
    except OSError:
        return removed
    for name in siblings:
        path = os.path.join(parent, name)
        if not name.startswith(LOCAL_DIR_PREFIX) or path == os.path.abspath(own_dir) or not os.path.isdir(path):
            continue
        holder = RootLease(CheckpointStore(path), run_id="")._holder()
        if holder is None or holder.host != socket.gethostname() or _pid_alive(holder.pid) or holder.run_id in _HELD_HERE:
            continue
        shutil.rmtree(path, ignore_errors=True)
        log.warning("removed %s, the local tier of %s, which is gone", path, holder.describe())
        removed.append(path)
    return removed
