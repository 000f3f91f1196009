"""Restoring in a new process and continuing reproduces the uninterrupted run bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "workers", "resume_script.py")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args: str) -> dict[int, float]:
    out = args[3]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.dirname(SCRIPT)]))
    subprocess.run([sys.executable, SCRIPT, *args], check=True, env=env, timeout=300)
    with open(out) as f:
        return {int(k): v for k, v in json.load(f).items()}


STEPS = 14


@pytest.fixture(scope="module")
def full(tmp_path_factory) -> dict[int, float]:
    """The uninterrupted run's losses, in a process of its own (the same run for every cell below)."""
    tmp = tmp_path_factory.mktemp("full")
    return _run("full", str(STEPS), str(tmp / "unused"), str(tmp / "full.json"))


@pytest.mark.parametrize(
    "window, consistency, request_at, expected_version",
    [(1, "replay", 6, 6), (5, "replay", 4, 8), (3, "stage", 5, 5)],
)
def test_resume_in_new_process_reproduces_losses(tmp_path, full, window, consistency, request_at, expected_version):
    steps = STEPS
    ckpts = str(tmp_path / "ckpts")
    saved = _run("save", str(steps), ckpts, str(tmp_path / "save.json"), str(window), consistency, str(request_at))
    assert saved[-1] == expected_version
    resumed = _run("resume", str(steps), ckpts, str(tmp_path / "resume.json"), str(window), consistency)
    assert sorted(resumed) == list(range(expected_version + 1, steps + 1))
    for step, loss in resumed.items():
        assert loss.hex() == full[step].hex(), f"loss at step {step} differs after resume"
