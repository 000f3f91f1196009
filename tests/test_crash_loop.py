"""A job killed and restarted ends bit-exact, with storage bounded: the crash loop, a few cycles per entry point.

Each entry point's script resumes with its one line (tests/workers/crash_loop_script.py),
is killed with a real SIGKILL at a seeded random step, and is run again, then finishes.
Its final state must equal, bit for bit, that of a twin that never stopped and never
checkpointed; the root and the tier must never hold more than keep + 1 and
local_keep + 1 checkpoints (before the lineage's retention, each restart left its
predecessor's checkpoints behind: 6 checkpoint-N with save_total_limit=3 after one
resume, 8 tier checkpoints with local_keep=2 after three); and the restarts must have
resumed (a loop that started fresh each time would end at the twin's state too).
``make soak`` runs 50 cycles of each (tests/workers/soak.py --crash-loop).
"""

from __future__ import annotations

import pytest
from crash_loop import BOUNDS, crash_loop, differences, twin_state

STEPS = {"plain": 16, "tier": 16, "lightning": 12, "hf": 12}
CYCLES = 2


@pytest.mark.parametrize("entry", ["plain", "tier", "lightning", "hf"])
def test_a_crash_loop_ends_bit_exact_with_storage_bounded(tmp_path, entry):
    if entry == "lightning":
        pytest.importorskip("pytorch_lightning")
    if entry == "hf":
        pytest.importorskip("transformers")
    want = twin_state(entry, str(tmp_path), STEPS[entry])
    report = crash_loop(entry, str(tmp_path), STEPS[entry], CYCLES, seed=sum(map(ord, entry)))
    assert report.failures == []
    assert report.cycles >= 1  # at least one run died by its SIGKILL
    assert differences(report.final, want) == []
    assert report.most_in_root <= BOUNDS["root"], report
    assert report.most_in_tier <= (BOUNDS["tier"] if entry == "tier" else 0), report
    # Every run after the first resumed where the one before it had committed, never behind it.
    assert report.resumed_at[0] == 0 and report.resumed_at[-1] > 0, report.resumed_at
    assert report.resumed_at == sorted(report.resumed_at), report.resumed_at
