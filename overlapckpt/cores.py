"""How many cores this process may run on: what the writer's and a load's thread counts start from.

Shared by both processes (the writer sizes its threads, a load in the training process
its readers).
"""

from __future__ import annotations

import os


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the platform has one), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
