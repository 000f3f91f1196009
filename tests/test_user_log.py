"""Told, not silent: without any logging set-up a run says which checkpoint it resumed, from where, and what it cost.

Before: a script that configured no logging saw nothing of a resume (Python's last-resort
handler shows warnings only), so a restart that silently started over looked like one that
resumed. Each case runs a fresh interpreter: the handler is installed at import.
"""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = r"""
import logging, sys
sys.path.insert(0, {tests!r})
import overlapckpt
from overlapckpt import Checkpointer
from helpers import make_run, train_step
setup = sys.argv[2]
if setup == "basicConfig":
    logging.basicConfig(level=logging.WARNING, format="ROOT %(name)s %(message)s")
elif setup == "quiet":
    overlapckpt.set_verbosity(logging.WARNING)
model, opt, sched, sampler = make_run()
with Checkpointer(model, opt, sys.argv[1], every=2, stateful={{"sched": sched, "sampler": sampler}}) as ckpt:
    ckpt.restore(missing_ok=True)
    for _ in range(2):
        train_step(model, opt, sched, sampler)
        ckpt.step()
"""


def _run(root: str, setup: str) -> str:
    code = SCRIPT.format(tests=os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", code, root, setup], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_a_first_run_a_resume_and_a_close_are_each_one_line_without_any_logging_set_up(tmp_path):
    root = str(tmp_path / "ckpts")
    first = [line for line in _run(root, "none").splitlines() if line.startswith("overlapckpt: ")]
    assert first[0] == f"overlapckpt: no checkpoint under {root} yet: starting fresh"
    assert first[-1].startswith(f"overlapckpt: closed {root}: 1 checkpoint(s) committed (steps 2), the loop blocked ")
    second = [line for line in _run(root, "none").splitlines() if line.startswith("overlapckpt: ")]
    assert second[0].startswith(f"overlapckpt: resumed {root}/step-000000002 (version 2) from the root in "), second
    assert second[-1].startswith(f"overlapckpt: closed {root}: 1 checkpoint(s) committed (steps 4)"), second


def test_one_call_silences_them_and_a_configured_root_logger_gets_each_line_once(tmp_path):
    root = str(tmp_path / "ckpts")
    assert "overlapckpt: " not in _run(root, "quiet")
    lines = _run(root, "basicConfig").splitlines()
    assert not any(line.startswith("overlapckpt: ") for line in lines), lines  # not our handler as well
    ours = [line for line in lines if line.startswith("ROOT overlapckpt.summary ")]
    assert [line.split()[2] for line in ours] == ["resumed", "closed"], lines
