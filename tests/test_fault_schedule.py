"""A few seeded random fault schedules in the suite (tests/fault_schedule.py); ``make soak`` runs 200.

Each trial drives real training processes and real writers through SIGKILLs of the writer
(between steps, at a file write inside a persist, inside a replay), of the trainer, and
slow storage; every listed checkpoint must equal the uninterrupted twin at its version,
and ``load()`` must pick the newest. The seeds cover every fault kind and mode; a failure
names its seed, and ``run_trial(seed)`` replays the same schedule.
"""

from __future__ import annotations

import pytest
from fault_schedule import describe, run_trial

# 2: window 1, the trainer killed twice, the writer at a persist's second write.
# 50: W=4 replay every 3 (windows cut to 3 steps), the writer killed between steps and inside a persist.
# 53: stage W=3, slow storage, the trainer and the writer killed.
# 45: W=3 replay, the writer killed inside a persist and inside a replay.
# (Chosen from a scan of seeds 1-80 on the scheduled windows, which land on the steps asked for.)
SEEDS = [2, 50, 53, 45]


@pytest.mark.parametrize("seed", SEEDS)
def test_every_listed_checkpoint_is_exact_through_a_random_fault_schedule(seed):
    result = run_trial(seed)
    assert result.faults_fired, f"no fault fired, so the trial tested nothing: {describe(result)}"
    assert result.checked, f"nothing was listed: {describe(result)}"
    assert result.violations == [], f"{describe(result)}\n" + "\n".join(result.violations)
