"""Preemption: SIGTERM inside a replay window commits the current step, then the process dies of it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from overlapckpt import Checkpointer, list_checkpoints, load

from helpers import assert_state_equal, make_run, read_child_line, train_step, twin_states

SCRIPT = os.path.join(os.path.dirname(__file__), "workers", "preempt_script.py")


def _twin_on_one_thread(steps: int) -> dict:
    # The child trains on 1 thread; an earlier test may have changed this process's count,
    # and CPU kernels are bit-identical only at the same thread count.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return twin_states(steps)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("how", ["outside", "process-group", "inside-hook"])
def test_sigterm_in_a_replay_window_commits_the_current_step_and_exits_with_the_signal(tmp_path, how):
    """process-group: SIGTERM to the whole group, as SLURM, systemd and Ctrl-C send it (the writer must not get it)."""
    twin = _twin_on_one_thread(8)
    script_how = "outside" if how == "process-group" else how
    child = subprocess.Popen(
        [sys.executable, SCRIPT, str(tmp_path), script_how], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        start_new_session=how == "process-group",
    )
    try:
        if how in ("outside", "process-group"):
            assert read_child_line(child, 120).strip() == "step 1"
            for expected in range(2, 5):
                assert read_child_line(child, 120).strip() == f"step {expected}"
            # At step 4 the window opened at 3 is half copied; the loop waits for our answer.
            signalled = time.monotonic()
            for _ in range(2):  # twice: the second is ignored while saving
                if how == "process-group":
                    os.killpg(child.pid, signal.SIGTERM)
                else:
                    child.send_signal(signal.SIGTERM)
            child.stdin.write(b"\n")
            child.stdin.flush()
        else:
            signalled = time.monotonic()
        assert child.wait(timeout=120) == -signal.SIGTERM
        exited_after_s = time.monotonic() - signalled
    finally:
        if child.poll() is None:
            child.kill()
    (info,) = list_checkpoints(str(tmp_path))
    # The signal is handled at the next iteration boundary: the end of step 5 in both cases,
    # inside the window opened at 3 (which would otherwise end at 6): closed early there.
    assert info.step == 5 and info.requested_step == 3, info
    manifest = json.loads((tmp_path / "step-000000005" / "overlapckpt.json").read_text())
    assert manifest["ledger"]["closed_early_at"] == 5
    assert manifest["stats"]["writer_restarts"] == 0  # the writer was not signalled: no restart spent the grace period
    assert exited_after_s < 60  # within the grace period the script set
    fresh, fresh_opt, _, _ = make_run(seed=3)
    load(str(tmp_path), fresh, fresh_opt)
    assert_state_equal(*twin[5], fresh, fresh_opt)


def test_leaving_with_on_an_exception_commits_complete_snapshots_and_lets_it_through(tmp_path):
    twin = twin_states(6)
    model, opt, sched, sampler = make_run()
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="the loop broke"):
        with Checkpointer(model, opt, tmp_path, window=3, consistency="replay", max_inflight=2, exit_timeout_s=30) as ckpt:
            for it in range(1, 5):
                train_step(model, opt, sched, sampler)
                if it in (2, 3):
                    ckpt.request()  # from 2: version 4, complete at step 4; from 3: its window is still open
                ckpt.step()
            assert ckpt.stats == []  # precondition: version 4 is complete in host memory, not yet sent
            raise RuntimeError("the loop broke")
    assert time.monotonic() - started < 60
    assert [i.step for i in list_checkpoints(str(tmp_path))] == [4]  # complete: committed; open: abandoned
    assert ckpt.snapshots_dropped == 1
    fresh, fresh_opt, _, _ = make_run(seed=3)
    load(str(tmp_path), fresh, fresh_opt)
    assert_state_equal(*twin[4], fresh, fresh_opt)


def test_with_a_local_tier_the_preemption_checkpoint_commits_there_first_then_in_the_root(tmp_path):
    """A real SIGTERM inside a hook: the final checkpoint is a request(), so both tiers get it, the local one first."""
    twin = _twin_on_one_thread(8)
    root, local = tmp_path / "root", tmp_path / "local"
    child = subprocess.Popen([sys.executable, SCRIPT, str(root), "inside-hook", str(local)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.wait(timeout=120) == -signal.SIGTERM
    finally:
        if child.poll() is None:
            child.kill()
    (in_root,) = list_checkpoints(str(root))
    (in_local,) = list_checkpoints(str(local))
    assert in_root.step == in_local.step == 5
    assert in_local.created_at <= in_root.created_at  # the local tier committed first
    for source in (in_local.path, in_root.path):
        fresh, fresh_opt, _, _ = make_run(seed=3)
        load(source, fresh, fresh_opt)
        assert_state_equal(*twin[5], fresh, fresh_opt)


def test_a_preemption_step_the_local_tier_alone_covers_is_checkpointed_to_the_root_too(tmp_path):
    """local_every=5 at window 1: the signal's step 5 is a local-tier-only version. The root must get it as well."""
    twin = _twin_on_one_thread(8)
    root, local = tmp_path / "root", tmp_path / "local"
    child = subprocess.Popen(
        [sys.executable, SCRIPT, str(root), "inside-hook", str(local), "local-only-at-5"], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert child.wait(timeout=120) == -signal.SIGTERM
    finally:
        if child.poll() is None:
            child.kill()
    assert [i.step for i in list_checkpoints(str(local))] == [5]
    assert [i.step for i in list_checkpoints(str(root))] == [5]
    fresh, fresh_opt, _, _ = make_run(seed=3)
    load(str(root), fresh, fresh_opt)
    assert_state_equal(*twin[5], fresh, fresh_opt)
