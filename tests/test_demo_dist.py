"""``examples/demo_dist.py`` end to end: 2 FSDP2 ranks under torchrun, then a one-process restore.

One launch, in a temporary directory, with fewer steps than ``make demo-dist``: the
demo itself compares the restored state with the 2-rank run's full state, and exits
non-zero if any tensor differs.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO_DIST = os.path.join(REPO, "examples", "demo_dist.py")
DEMO_TIMEOUT_S = 300  # a guard against a hang, not a speed claim: it takes ~30 s on 2 cores


def test_demo_dist_restores_the_two_rank_fsdp2_state_in_one_process_bit_for_bit(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    # every=5, window 3 replay: the windows open after steps 3 and 8, and the versions are the steps asked for, 5 and 10
    command = [sys.executable, str(DEMO_DIST), "--nproc", "2", "--steps", "12", "--every", "5", "--window", "3"]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=DEMO_TIMEOUT_S)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    assert re.search(r"restored model and optimizer state matches the 2-rank run's full state at version 10 bit for bit", output), output[-6000:]
    assert "per-rank state is refused at another world size" in output, output[-6000:]
    checkpoints = sorted(n for n in os.listdir(tmp_path / "demo-dist-checkpoints") if n.startswith("step-"))
    assert checkpoints == ["step-000000005", "step-000000010"], checkpoints
    shards = sorted(n for n in os.listdir(tmp_path / "demo-dist-checkpoints" / "step-000000010") if n.endswith(".distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"], shards  # each rank wrote its own shards
