"""How often the writers poll the job's store while nothing happens: a bounded load on its server at any world size.

Idle writers look for a replaced writer's new generation and for checkpoints other ranks
claimed (``process.py``: 3 requests a poll), and the preemption watch for another rank's
signal (``preempt_watch.py``: 1 request). Every rank's polls go to the one server of the
job's store: at a fixed interval its load grows with the world size
(``benchmarks/results/scale/run1.txt``: 5.9 requests per idle writer per second, which
saturates the measured server past about 4,000 ranks; ``docs/scale.md``). So past the
world size where polls of one kind would take more than ``SERVER_BUDGET_REQUESTS_PER_S``
at the server, the interval grows with the world size instead, and the time to notice
grows with it: at 8,192 ranks an idle writer notices a new generation within 4.1 s, and a
rank another rank's signal within 1.4 s (grace periods are tens of seconds).
"""

from __future__ import annotations

# Small jobs poll as often as before: an idle writer twice a second, the preemption watch
# every 10 ms (a page read is a memory access; a store check one round trip).
IDLE_POLL_S = 0.5
PREEMPTION_POLL_S = 0.01
IDLE_REQUESTS_PER_POLL = 3  # generation_moved's check and get, missing_claim's check
PREEMPTION_REQUESTS_PER_POLL = 1  # the signal key's check
# What all ranks' polls of one kind may add at the server, in requests per second: a quarter
# of what one TCPStore server answered on the project's 2-core VM (24,701 /s, run1.txt above).
SERVER_BUDGET_REQUESTS_PER_S = 6_000


def poll_interval_s(world_size: int, floor_s: float, requests_per_poll: int) -> float:
    """The interval at which ``world_size`` ranks' polls stay within the server's budget, and never below ``floor_s``."""
    return max(floor_s, world_size * requests_per_poll / SERVER_BUDGET_REQUESTS_PER_S)
