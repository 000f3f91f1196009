"""Who a lease's holder is, and when it is provably gone: host, boot, PID namespace and pid.

A pid means something only within one PID namespace of one boot of one machine.
Containers that share ``/dev/shm`` and the host name (``--ipc=host --net=host``) but not
PIDs see different processes under the same number, so a lease that records only host
and pid makes a live job in the next container look dead: its tier is swept, its root's
lease taken over. A lease therefore records the boot id (``/proc/sys/kernel/random/boot_id``)
and the PID namespace (the inode of ``/proc/self/ns/pid``) too, and a holder is provably
gone only when:

- it is on this host, and ran in an earlier boot of it (no process outlives a reboot); or
- it is on this host, in this boot and this PID namespace, and its pid does not exist.

A holder in another PID namespace, on another host, or from a lease that does not record
these (an older overlapckpt wrote it) is never taken for dead: the caller names the file
to delete once that job is known to be gone.
"""

from __future__ import annotations

import functools
import os
import socket
from dataclasses import dataclass
from typing import Any

_BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
_PID_NAMESPACE_PATH = "/proc/self/ns/pid"


@dataclass(frozen=True)
class ProcessIdentity:
    """Where a process runs: what a lease records beside its run."""

    pid: int
    host: str
    boot_id: str  # "" where the system does not say (not Linux)
    pid_namespace: str  # "" likewise

    def fields(self) -> dict[str, Any]:
        return {"pid": self.pid, "host": self.host, "boot_id": self.boot_id, "pid_namespace": self.pid_namespace}

    @classmethod
    def from_record(cls, raw: dict[str, Any]) -> ProcessIdentity:
        """From a lease or claim record; ValueError/KeyError/TypeError when it is not one. Missing ids read as unknown."""
        boot_id, namespace = raw.get("boot_id"), raw.get("pid_namespace")
        return cls(
            pid=int(raw["pid"]),
            host=str(raw["host"]),
            boot_id=boot_id if isinstance(boot_id, str) else "?",
            pid_namespace=namespace if isinstance(namespace, str) else "?",
        )


@functools.lru_cache(maxsize=1)
def _boot_id() -> str:
    try:
        with open(_BOOT_ID_PATH) as f:
            return f.read(64).strip()
    except OSError:
        return ""


def _pid_namespace() -> str:
    try:
        return os.readlink(_PID_NAMESPACE_PATH)  # "pid:[4026531836]"
    except OSError:
        return ""


def this_process() -> ProcessIdentity:
    return ProcessIdentity(pid=os.getpid(), host=socket.gethostname(), boot_id=_boot_id(), pid_namespace=_pid_namespace())


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def is_provably_gone(holder: ProcessIdentity) -> bool:
    """Whether ``holder``'s process cannot be running: see the module docstring."""
    me = this_process()
    if holder.host != me.host or not me.boot_id or holder.boot_id == "?":
        return False
    if holder.boot_id != me.boot_id:
        return True  # an earlier boot of this host
    if not me.pid_namespace or holder.pid_namespace != me.pid_namespace:
        return False  # another container's pids: not ours to check
    return not _pid_alive(holder.pid)


def same_process_space(holder: ProcessIdentity) -> bool:
    """Whether ``holder``'s pid names a process this one can see: this host, boot and PID namespace."""
    me = this_process()
    return holder.host == me.host and holder.boot_id == me.boot_id and holder.pid_namespace == me.pid_namespace
