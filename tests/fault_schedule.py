"""Seeded random fault schedules against real training processes and writers: every listed checkpoint exact.

A trial draws, from its seed, a mode (window 1, replay at W=2..4, stage), a cadence, and
faults: SIGKILL of the writer between steps, at a file write inside a persist, or inside a
replay; SIGKILL of the trainer; slow storage. It runs tests/workers/fault_trainer.py until the run
reaches its last step, restarting it after each death of the trainer (it resumes with
``load()``), then checks every listed checkpoint against an uninterrupted twin, bit for bit,
and that ``load()`` picks the newest. ``python tests/workers/soak.py`` runs many; the suite a few.

A failing trial names its seed; ``run_trial(seed)`` replays the same schedule.
"""

from __future__ import annotations

import copy
import json
import os
import random
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any

import torch

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS_DIR)
MODES = [(1, "replay"), (2, "replay"), (3, "replay"), (4, "replay"), (3, "stage")]
TRAINER_TIMEOUT_S = 240.0
MAX_TRAINER_STARTS = 4


def make_trial_run():
    """The trial's model, optimizer (fakes.AdamW: torch's, with the replay fault), scheduler and sampler."""
    from fakes import AdamW
    from helpers import make_run

    model, _, _, sampler = make_run()
    opt = AdamW(model.parameters(), lr=1e-2, foreach=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.05 * s))
    return model, opt, sched, sampler


def trial_step(model, opt, sched, sampler, count: bool = True) -> None:
    """One iteration; ``count=False``: a zero-gradient step that only creates the optimizer state (before a load)."""
    from helpers import train_step

    if count:
        train_step(model, opt, sched, sampler)
        return
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)


def twin_states(steps: int) -> dict[int, tuple[dict, dict]]:
    """The uninterrupted run's model and optimizer state dicts after each step."""
    torch.set_num_threads(1)  # as the trainer: the same kernels, the same bits
    model, opt, sched, sampler = make_trial_run()
    states = {}
    for s in range(1, steps + 1):
        trial_step(model, opt, sched, sampler)
        states[s] = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
    return states


@dataclass
class Trial:
    seed: int
    window: int
    consistency: str
    every: int
    steps: int
    keep: int | None
    slow_write_s: float
    trainer_faults: list[dict[str, Any]] = field(default_factory=list)
    writer_faults: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def draw(cls, seed: int) -> Trial:
        rng = random.Random(seed)
        window, consistency = rng.choice(MODES)
        steps = rng.randint(14, 22)
        trial = cls(
            seed=seed, window=window, consistency=consistency, every=rng.choice([2, 3, 4]), steps=steps,
            keep=rng.choice([None, 2, 3]), slow_write_s=rng.choice([0.0, 0.0, 0.02, 0.1]),
        )
        for k in range(rng.randint(1, 3)):
            kind = rng.choice(["kill-writer", "kill-writer", "persist-write", "replay-step", "kill-trainer"])
            fault_id = f"f{k}-{kind}"
            at_step = rng.randint(2, steps - 2)
            if kind in ("kill-writer", "kill-trainer"):
                trial.trainer_faults.append({"id": fault_id, "kind": kind, "at_step": at_step})
            elif kind == "persist-write":
                trial.writer_faults.append({"id": fault_id, "kind": kind, "at_step": at_step, "write": rng.randint(1, 4)})
            elif consistency == "replay" and window > 1:
                trial.writer_faults.append({"id": fault_id, "kind": kind, "after_steps": rng.randint(1, 3 * (window - 1))})
        return trial

    def config(self) -> dict[str, Any]:
        return {
            "window": self.window, "consistency": self.consistency, "every": self.every, "steps": self.steps,
            "keep": self.keep, "trainer_faults": self.trainer_faults,
        }


@dataclass
class TrialResult:
    trial: Trial
    trainer_starts: int
    faults_fired: list[str]
    checked: list[int]  # the versions listed and compared with the twin
    violations: list[str]


def run_trial(seed: int, twin: dict[int, tuple[dict, dict]] | None = None) -> TrialResult:
    """Run the trial of ``seed`` end to end and check what it listed."""
    from overlapckpt import list_checkpoints, load

    from fakes import FAULTS_ENV, FIRED_DIR_ENV, SLOW_WRITE_S_ENV
    from helpers import make_run

    trial = Trial.draw(seed)
    twin = twin or twin_states(trial.steps)
    with tempfile.TemporaryDirectory(prefix=f"fault-trial-{seed}-") as tmp:
        root, fired = os.path.join(tmp, "ckpts"), os.path.join(tmp, "fired")
        os.mkdir(fired)
        env = dict(os.environ, **{FAULTS_ENV: json.dumps(trial.writer_faults), FIRED_DIR_ENV: fired,
                                  SLOW_WRITE_S_ENV: str(trial.slow_write_s), "OMP_NUM_THREADS": "1"})
        env["PYTHONPATH"] = os.pathsep.join([REPO, TESTS_DIR, env.get("PYTHONPATH", "")])
        starts, violations = 0, []
        while True:
            starts += 1
            proc = subprocess.run(
                [sys.executable, os.path.join(TESTS_DIR, "workers", "fault_trainer.py"), root, json.dumps(trial.config())],
                env=env, capture_output=True, text=True, timeout=TRAINER_TIMEOUT_S,
            )
            if proc.returncode == 0 and "done" in proc.stdout:
                break
            if proc.returncode != -9 or starts >= MAX_TRAINER_STARTS:  # only our own SIGKILL may end a trainer
                violations.append(f"trainer exited {proc.returncode}: {proc.stderr[-2500:]}")
                break
        listed = list_checkpoints(root) if os.path.isdir(root) else []
        for info in listed:
            model, opt, _, _ = make_run(seed=5)
            trial_step(model, opt, None, None, count=False)
            load(root, model, opt, step=info.step)
            bad = _differs(twin[info.step], model, opt)
            if bad:
                violations.append(f"listed checkpoint {os.path.basename(info.path)} (version {info.step}) differs in {bad}")
        if listed:
            model, opt, _, _ = make_run(seed=5)
            trial_step(model, opt, None, None, count=False)
            newest = max(i.step for i in listed)
            if load(root, model, opt).step != newest:
                violations.append(f"load() did not pick the newest listed version {newest}")
        return TrialResult(trial, starts, sorted(os.listdir(fired)), [i.step for i in listed], violations)


def _differs(expected: tuple[dict, dict], model, opt) -> list[str]:
    model_sd, opt_sd = expected
    out = [k for k, v in model_sd.items() if not torch.equal(v, model.state_dict()[k])]
    live = opt.state_dict()["state"]
    for pid, st in opt_sd["state"].items():
        out += [f"optimizer.{pid}.{k}" for k, v in st.items() if torch.is_tensor(v) and not torch.equal(v, live[pid][k])]
    return out


def describe(result: TrialResult) -> str:
    t = result.trial
    return (
        f"seed {t.seed}: window {t.window} {t.consistency}, every {t.every}, {t.steps} steps, keep {t.keep}, "
        f"slow writes {t.slow_write_s} s, faults {t.trainer_faults + t.writer_faults}; fired {result.faults_fired}, "
        f"{result.trainer_starts} trainer start(s), checked versions {result.checked}"
    )
