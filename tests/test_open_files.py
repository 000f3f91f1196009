"""The writer's open-file limit raised for its group's sockets (``writer/open_files.py``), in a child process each (a lowered hard limit stays lowered)."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = """
import json, logging, resource, sys
soft, hard = int(sys.argv[1]), int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
records = []
class Keep(logging.Handler):
    def emit(self, record): records.append(record.getMessage())
logging.getLogger("overlapckpt").addHandler(Keep())
from overlapckpt.writer.open_files import raise_open_file_limit
raise_open_file_limit(int(sys.argv[3]))
print(json.dumps({"limit": resource.getrlimit(resource.RLIMIT_NOFILE), "warnings": records}))
"""


def _run(soft: int, hard: int, world_size: int) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(soft), str(hard), str(world_size)],
        env=dict(os.environ, PYTHONPATH=REPO), capture_output=True, text=True, timeout=120, check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_soft_limit_below_the_groups_sockets_is_raised_and_a_hard_one_is_named_with_the_fix():
    hard = 4096  # a child may lower its hard limit, never raise it past this process's
    ours = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if ours != resource.RLIM_INFINITY and ours < hard:
        pytest.skip(f"this process's hard limit on open files is {ours}; the test lowers it to {hard} in a child, so it needs at least that")
    raised = _run(1024, hard, 1500)  # 1,500 ranks: 2 x 1,500 + 512 = 3,512 open files
    assert raised == {"limit": [3512, hard], "warnings": []}, raised
    enough = _run(1024, hard, 100)  # 712 needed: the limit is left as it is
    assert enough == {"limit": [1024, hard], "warnings": []}, enough
    capped = _run(1024, 2048, 1500)  # the hard limit is below the need: raised to it, and named
    assert capped["limit"] == [2048, 2048], capped
    (warning,) = capped["warnings"]
    assert "the writer of a 1500-rank group may need 3512 open files" in warning and "its limit is 2048 (hard limit 2048)" in warning, warning
    assert "ulimit -Hn" in warning and "--ulimit nofile=" in warning, warning
