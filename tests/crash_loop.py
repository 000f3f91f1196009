"""The crash loop: run a training script, SIGKILL it at a seeded random step, run it again, until it finishes.

Shared by tests/test_crash_loop.py (a few cycles per entry point, in ``make test``) and
tests/workers/soak.py's ``--crash-loop`` (50 cycles per entry point, ``make soak``). The
script is tests/workers/crash_loop_script.py; what is checked after every cycle is what
a user restarting a job relies on: no cycle raises, and neither the root nor the tier
ever holds more than ``keep + 1`` checkpoints.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from dataclasses import dataclass, field

import torch

from overlapckpt import CheckpointStore

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "crash_loop_script.py")
sys.path.insert(0, os.path.dirname(SCRIPT))
from crash_loop_script import KEEP, LOCAL_KEEP  # noqa: E402

LAUNCH_TIMEOUT_S = 300.0
# A cycle trains 1 to this many steps past wherever it resumed before its SIGKILL.
MOST_STEPS_PER_CYCLE = 5
# Each script's checkpoint cadence, in steps (Lightning's at epoch ends, where a plain DataLoader resumes exactly).
CADENCE_STEPS = {"plain": 2, "tier": 1, "lightning": 4, "hf": 2}


@dataclass
class CrashLoopReport:
    entry: str
    cycles: int = 0  # runs killed by SIGKILL
    most_in_root: int = 0  # committed checkpoints, after any cycle
    most_in_tier: int = 0
    final: dict = field(default_factory=dict)  # the final run's model and optimizer state dicts
    resumed_at: list[int] = field(default_factory=list)  # the step each run resumed at (0: started fresh), in order
    failures: list[str] = field(default_factory=list)  # a cycle that exited other than by its SIGKILL


def _run(
    entry: str, root: str, local_dir: str, steps: int, kill_after: int, out: str, twin: bool = False, settle: bool = False
) -> subprocess.CompletedProcess:
    command = [sys.executable, SCRIPT, entry, "--root", root, "--local-dir", local_dir, "--steps", str(steps), "--out", out]
    command += ["--kill-after", str(kill_after)] + (["--twin"] if twin else []) + (["--settle"] if settle else [])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.run(command, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S, env=env)


def _committed(directory: str) -> int:
    return len(CheckpointStore(directory).committed_names()) if os.path.isdir(directory) else 0


def twin_state(entry: str, workdir: str, steps: int) -> dict:
    """The uninterrupted run without checkpointing: the state every crash loop must end at."""
    out = os.path.join(workdir, f"{entry}-twin.pt")
    done = _run(entry, os.path.join(workdir, f"{entry}-twin-root"), os.path.join(workdir, f"{entry}-twin-tier"), steps, 0, out, twin=True)
    if done.returncode != 0:
        raise AssertionError(f"the {entry} twin failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return torch.load(out, weights_only=False)


def crash_loop(entry: str, workdir: str, steps: int, cycles: int, seed: int) -> CrashLoopReport:
    """Kill the script ``cycles`` times at seeded random steps, then let it finish; report what each cycle left."""
    rng = random.Random(seed)
    root, local_dir = os.path.join(workdir, f"{entry}-root"), os.path.join(workdir, f"{entry}-tier")
    out = os.path.join(workdir, f"{entry}-final.pt")
    report = CrashLoopReport(entry)
    for cycle in range(cycles):
        # The first kill, and about half the others, come once the commits in flight have landed (so the loop
        # makes progress on a slow machine); the rest land wherever the writer is, mid-persist included.
        settle = cycle == 0 or rng.random() < 0.5
        least = CADENCE_STEPS[entry] if cycle == 0 else 1  # the first run lives to its first checkpoint
        done = _run(entry, root, local_dir, steps, rng.randint(least, least + MOST_STEPS_PER_CYCLE - 1), out, settle=settle)
        report.most_in_root = max(report.most_in_root, _committed(root))
        report.most_in_tier = max(report.most_in_tier, _committed(local_dir))
        if done.returncode == 0:
            break  # it resumed close enough to the end to finish before its kill
        if done.returncode != -signal.SIGKILL:
            report.failures.append(f"exit {done.returncode}:\n{done.stderr[-4000:]}")
            return report
        report.cycles += 1
    if not os.path.exists(out):
        done = _run(entry, root, local_dir, steps, 0, out)
        report.most_in_root = max(report.most_in_root, _committed(root))
        report.most_in_tier = max(report.most_in_tier, _committed(local_dir))
        if done.returncode != 0:
            report.failures.append(f"the final run: exit {done.returncode}:\n{done.stderr[-4000:]}")
            return report
    report.final = torch.load(out, weights_only=False)
    with open(out + ".resumed") as f:
        report.resumed_at = [int(line) for line in f]
    return report


def differences(got: dict, want: dict) -> list[str]:
    """The tensors and values of two final states that differ, bit for bit (empty: equal)."""
    wrong = [k for k, v in want["model"].items() if not torch.equal(got["model"][k], v)]
    opt_got, opt_want = got["optimizer"], want["optimizer"]
    if opt_got["param_groups"] != opt_want["param_groups"]:
        wrong.append("optimizer param_groups")
    for i, s in opt_want["state"].items():
        for k, v in s.items():
            same = torch.equal(opt_got["state"][i][k], v) if torch.is_tensor(v) else opt_got["state"][i][k] == v
            if not same:
                wrong.append(f"optimizer state {i}.{k}")
    return wrong


BOUNDS = {"root": KEEP + 1, "tier": LOCAL_KEEP + 1}
