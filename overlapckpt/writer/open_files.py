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
    """Open files a writer of a group of ``world_size`` ranks may hold: a socket per other rank, twice over (its node's and the leaders' groups), and the rest."""
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
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (OSError, ValueError) as e:
            log.warning("overlapckpt: could not raise the writer's open-file limit from %d to %d: %s", soft, target, e)
    if soft < needed:
        log.warning(
            "overlapckpt: the writer of a %d-rank group may need %d open files (a socket per rank), but its limit is %d "
            "(hard limit %d): the writers' group may fail to form with 'Too many open files'. Raise the hard limit "
            "for the job (ulimit -Hn, or LimitNOFILE= in its systemd unit, or the container's --ulimit nofile=)",
            world_size, needed, soft, hard,
        )
