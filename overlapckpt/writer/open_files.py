"""The writer's limit on open files, raised to what its group's connections need.

Runs in the writer process, before it joins the writers' gloo group. Gloo connects every
pair of ranks in a group when the group is made: a writer holds one socket per other rank
(and one per member of its node's and, on a leader, the leaders' group, ``node_tree.py``).
Many hosts give a process a soft limit of 1,024 open files, so past about a thousand
ranks the group would fail to form with ``EMFILE`` ("Too many open files") from inside
gloo. The soft limit may be raised up to the hard one without privilege, as a job's
launcher often does; where even the hard limit is too low, the warning names it and the fix.
"""

from __future__ import annotations

import logging

log = logging.getLogger("overlapckpt")

# Beyond the group's sockets: the store's client, the pipes to the trainer, the shared slots'
# descriptors, the checkpoint files DCP writes on its threads, torch's own.
OTHER_OPEN_FILES = 512


def open_files_needed(world_size: int) -> int:
    """Open files a writer of a group of ``world_size`` ranks may hold: a socket per other rank in the group of every
    rank, at most as many again in its node's and the leaders' groups (``node_tree.py``: K + N/K), and the rest."""
    return 2 * world_size + OTHER_OPEN_FILES


def raise_open_file_limit(world_size: int) -> None:
    """Raise this process's soft limit on open files to what ``world_size`` ranks need (at most the hard limit); warn where it cannot."""
    try:
        import resource
    except ImportError:  # not on POSIX: nothing to raise
        return
    needed = open_files_needed(world_size)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    refused: str | None = None
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (OSError, ValueError) as e:  # a system cap below the hard limit (macOS's OPEN_MAX), say
            refused = f"raising it to {target} was refused ({e})"
    if soft >= needed:
        return
    hard_text = "unlimited" if hard == resource.RLIM_INFINITY else str(hard)
    fix = (
        "raise the system's own cap on a process's open files" if refused is not None
        else "raise the hard limit for the job (ulimit -Hn, or LimitNOFILE= in its systemd unit, or the container's --ulimit nofile=)"
    )
    log.warning(
        "overlapckpt: the writer of a %d-rank group may need %d open files (a socket per rank), but its limit is %d "
        "(hard limit %s)%s: the writers' group may fail to form with 'Too many open files'. To fix it, %s",
        world_size, needed, soft, hard_text, f"; {refused}" if refused is not None else "", fix,
    )
