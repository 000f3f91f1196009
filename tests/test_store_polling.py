"""The writers' idle polls add a bounded load to the job's store at any world size, and poll as often as before in
small jobs (at 8,192 ranks a fixed 0.5 s idle poll was 49,000 requests per second at one server, twice what the
project's VM served: benchmarks/results/scale/run1.txt, docs/scale.md)."""

from __future__ import annotations

import pytest

from overlapckpt.writer.store_polling import (
    IDLE_POLL_S,
    IDLE_REQUESTS_PER_POLL,
    PREEMPTION_POLL_S,
    PREEMPTION_REQUESTS_PER_POLL,
    SERVER_BUDGET_REQUESTS_PER_S,
    poll_interval_s,
)

KINDS = [(IDLE_POLL_S, IDLE_REQUESTS_PER_POLL), (PREEMPTION_POLL_S, PREEMPTION_REQUESTS_PER_POLL)]


@pytest.mark.parametrize("floor_s, requests_per_poll", KINDS, ids=["idle", "preemption"])
@pytest.mark.parametrize("world_size", [2, 16, 256, 1024, 8192, 65536])
def test_all_ranks_polls_stay_within_the_servers_budget(world_size, floor_s, requests_per_poll):
    interval_s = poll_interval_s(world_size, floor_s, requests_per_poll)
    assert interval_s >= floor_s
    assert world_size * requests_per_poll / interval_s <= SERVER_BUDGET_REQUESTS_PER_S * (1 + 1e-12)


@pytest.mark.parametrize("floor_s, requests_per_poll", KINDS, ids=["idle", "preemption"])
def test_small_jobs_poll_as_often_as_before(floor_s, requests_per_poll):
    assert poll_interval_s(16, floor_s, requests_per_poll) == floor_s
    assert (poll_interval_s(8192, floor_s, requests_per_poll) > floor_s) is True


def test_at_8192_ranks_a_rank_notices_within_seconds():
    assert poll_interval_s(8192, IDLE_POLL_S, IDLE_REQUESTS_PER_POLL) == pytest.approx(4.096)
    assert poll_interval_s(8192, PREEMPTION_POLL_S, PREEMPTION_REQUESTS_PER_POLL) == pytest.approx(1.365, abs=1e-3)
