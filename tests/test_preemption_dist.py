"""Preemption under torchrun: a real SIGTERM, to the agent or to one rank, and one checkpoint every rank commits.

Each test launches ``python -m torch.distributed.run --standalone --nproc_per_node=2
tests/workers/preempt_worker.py`` (2 DDP ranks, gloo, rank 1 slower), waits until both ranks
are training, sends SIGTERM, and waits for the agent to exit. Then:

- exactly one checkpoint is committed, by both ranks (``world_size`` 2), at one version;
- each rank's state at that version (kept by the worker) equals what the checkpoint
  loads into a plain model, bit for bit;
- each worker exited with SIGTERM (its chained handler ran after the commit), and
  the agent never had to escalate to SIGKILL (it logs that when it does, 30 s in).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest
import torch

from overlapckpt import list_checkpoints, load

from helpers import TinyNet, read_child_line

WORKER = os.path.join(os.path.dirname(__file__), "workers", "preempt_worker.py")
LAUNCH_TIMEOUT_S = 180


def _launch(out: str, window: int) -> tuple[subprocess.Popen, dict[int, int], str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    agent = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", WORKER, out, str(window)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )
    pids: dict[int, int] = {}
    lines: list[str] = []
    try:
        while len(pids) < 2:
            line = read_child_line(agent, timeout_s=LAUNCH_TIMEOUT_S)
            lines.append(line)
            for rank, pid in re.findall(r"READY (\d+) (\d+)", line):
                pids[int(rank)] = int(pid)
    except BaseException:
        os.killpg(agent.pid, signal.SIGKILL)
        raise
    return agent, pids, "".join(lines)


def _finish(agent: subprocess.Popen, started: str) -> str:
    """The job's whole output, from ``started`` (what ``_launch`` read) to its end."""
    try:
        rest, _ = agent.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(agent.pid, signal.SIGKILL)
        rest, _ = agent.communicate()
        pytest.fail(f"the job did not end after SIGTERM:\n{rest.decode(errors='replace')[-4000:]}")
    return started + rest.decode(errors="replace")


def _check_one_exact_checkpoint(out: str, output: str) -> None:
    results = []
    # overlapckpt's own lines (agreement, holds, exits) come first in a failure's message: the
    # end of the output is mostly the tracebacks of the rank that lost its peer.
    ours = "\n".join(line for line in output.splitlines() if "overlapckpt" in line and "ignored" not in line)
    for rank in range(2):
        path = os.path.join(out, f"rank{rank}.json")
        assert os.path.exists(path), f"rank {rank} did not reach its SIGTERM handler:\n{ours[-4000:]}\n...\n{output[-3000:]}"
        with open(path) as f:
            results.append(json.load(f))
    infos = list_checkpoints(os.path.join(out, "ckpts"))
    assert len(infos) == 1, (infos, output[-3000:])  # one checkpoint, nothing partial listed
    (info,) = infos
    assert info.world_size == 2
    torch.manual_seed(7)
    model = TinyNet(width=32, features=8, outputs=4, dropout=0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    load(info.path, model, opt, per_rank_state="skip")
    for r in results:
        assert r["committed"] == [info.step], r  # both ranks saw it committed before exiting
        assert r["last_step"] == info.step, r  # each rank stopped at the agreed step
        expected = torch.load(r["state_file"])
        # Parameters and optimizer state are the same on both DDP ranks; the BatchNorm buffers
        # are rank 0's (DDP broadcasts them from rank 0 at each forward, and stores rank 0's).
        for k, v in model.state_dict().items():
            if r["rank"] == 0 or not k.startswith("norm.running") and not k.endswith("num_batches_tracked"):
                assert torch.equal(v, expected[f"model.{k}"]), (r["rank"], k)
        for name, p in model.named_parameters():
            for k, v in opt.state[p].items():
                assert torch.equal(v, expected[f"optimizer.state.{name}.{k}"]), (r["rank"], name, k)
    assert "forcefully exiting via" not in output, output[-3000:]  # no worker outlived the grace: no SIGKILL
    # Rank 0 forged three preemption signals in the store before READY: each was refused, none stopped the job.
    assert "FORGED_REFUSED 3" in output, output[-3000:]
    assert output.count("preemption watch ignored signal in the job's store") >= 3, output[-3000:]
    assert output.count("exitcode: -15") + output.count("Signal 15") >= 1 or "SIGTERM" in output, output[-3000:]


def test_sigterm_to_the_torchrun_agent_commits_one_checkpoint_on_every_rank(tmp_path):
    agent, _, started = _launch(str(tmp_path), window=1)
    agent.send_signal(signal.SIGTERM)  # torchrun forwards it to every worker
    output = _finish(agent, started)
    _check_one_exact_checkpoint(str(tmp_path), output)


def test_sigterm_to_one_rank_only_commits_one_checkpoint_on_every_rank(tmp_path):
    agent, pids, started = _launch(str(tmp_path), window=3)
    os.kill(pids[1], signal.SIGTERM)  # only the slower rank is signalled: its writer tells rank 0's
    output = _finish(agent, started)
    _check_one_exact_checkpoint(str(tmp_path), output)
