"""Faults the run must survive: a writer killed at any moment, a training process killed, leaks."""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys

import pytest
import torch

from overlapckpt import WriterDiedError, list_checkpoints, load
from overlapckpt.seams import Checkpointer, engine_of
from overlapckpt.train.copying.cpu_copier import CpuCopier

from fakes import BLOCK_FIFO_ENV, BLOCK_ONCE_MARKER_ENV, ONLY_NAME_ENV, BlockingOnceStore
from helpers import assert_state_equal, exited_within, make_run, read_child_line, read_fifo_line, train_step, twin_states

STEPS = 9


def _kill_writer(ckpt: Checkpointer) -> int:
    pid = ckpt.writer_pid
    os.kill(pid, signal.SIGKILL)
    engine_of(ckpt).parts.link.writer._proc.wait(timeout=30)  # dead and reaped before training goes on
    return pid


@pytest.mark.parametrize("moment", ["idle", "mid-copy", "mid-persist", "mid-persist-replay"])
def test_a_killed_writer_is_replaced_and_later_checkpoints_are_exact(tmp_path, monkeypatch, moment):
    # mid-persist-replay: the writer dies after it replayed the window into the shared slot,
    # in place, inside the shard write; what its successor persists must still be version 5.
    twin = twin_states(STEPS)
    fifo = tmp_path / "block.fifo"
    if moment.startswith("mid-persist"):
        os.mkfifo(fifo)
        monkeypatch.setenv(BLOCK_FIFO_ENV, str(fifo))
        monkeypatch.setenv(ONLY_NAME_ENV, "step-000000005" if moment == "mid-persist-replay" else "step-000000003")
        monkeypatch.setenv(BLOCK_ONCE_MARKER_ENV, str(tmp_path / "blocked-once"))
    model, opt, sched, sampler = make_run()
    window = 3 if moment in ("mid-copy", "mid-persist-replay") else 1
    # Copies at the call: the snapshot is complete, and goes to the writer, at ckpt.step().
    ckpt = Checkpointer(
        model, opt, tmp_path / "ckpts", window=window, consistency="replay", store_class=BlockingOnceStore, copier=CpuCopier()
    )
    killed = []
    with pytest.warns(UserWarning, match=r"the writer process died .* a new one was started"):
        try:
            for it in range(1, STEPS + 1):
                train_step(model, opt, sched, sampler)
                if it == 3:
                    ckpt.request()
                if moment == "idle" and it == 2:
                    killed.append(_kill_writer(ckpt))
                if moment == "mid-copy" and it == 4:  # the window opened at 3 is copying
                    killed.append(_kill_writer(ckpt))
                if moment == "mid-copy" and it == 6:
                    ckpt.request()  # the dropped one asked again
                ckpt.step()
                if moment == "mid-persist" and it == 3:
                    read_fifo_line(str(fifo), timeout_s=120)  # the writer is inside the shard write of step 3
                    killed.append(_kill_writer(ckpt))
                if moment == "mid-persist-replay" and it == 5:
                    read_fifo_line(str(fifo), timeout_s=120)  # replayed to version 5, inside its shard write
                    killed.append(_kill_writer(ckpt))
            infos = ckpt.wait(timeout_s=120)
        finally:
            ckpt.close(timeout_s=60)
    assert ckpt.writer_restarts == 1 and ckpt.writer_pid != killed[0]
    expected = {"idle": [3], "mid-copy": [8], "mid-persist": [3], "mid-persist-replay": [5]}[moment]
    assert [i.step for i in infos] == expected
    assert ckpt.snapshots_dropped == (1 if moment == "mid-copy" else 0)
    assert [i.step for i in list_checkpoints(str(tmp_path / "ckpts"))] == expected
    fresh, fresh_opt, _, _ = make_run(seed=5)
    load(str(tmp_path / "ckpts"), fresh, fresh_opt)
    assert_state_equal(*twin[expected[0]], fresh, fresh_opt)


def test_restarts_are_bounded_then_the_death_is_raised(tmp_path):
    model, opt, sched, sampler = make_run()
    with pytest.warns(UserWarning, match=r"a new one was started"):
        with Checkpointer(model, opt, tmp_path, max_writer_restarts=1) as ckpt:
            train_step(model, opt, sched, sampler)
            _kill_writer(ckpt)
            train_step(model, opt, sched, sampler)  # the hook notices and replaces it
            assert ckpt.writer_restarts == 1
            _kill_writer(ckpt)
            with pytest.raises(WriterDiedError, match=r"was killed by SIGKILL"):
                train_step(model, opt, sched, sampler)
            with pytest.raises(WriterDiedError):
                ckpt.request()


# Every moment with memfd buffers; the file fallback (OVERLAPCKPT_SHM_DIR) at the moment that
# holds the most: a persist in flight (its other cells repeated the memfd ones' checks).
@pytest.mark.parametrize(
    ("moment", "shm_dir"),
    [("constructed", False), ("mid-copy", False), ("mid-persist", False), ("mid-persist", True)],
    ids=["constructed-memfd", "mid-copy-memfd", "mid-persist-memfd", "mid-persist-shm-dir"],
)
def test_a_killed_training_process_leaves_no_files_and_no_writer(tmp_path, moment, shm_dir):
    env = dict(os.environ, **{BLOCK_FIFO_ENV: str(tmp_path / "fifo"), ONLY_NAME_ENV: "step-000000006"})
    shm = tmp_path / "shm"
    shm.mkdir()
    if shm_dir:
        env["OVERLAPCKPT_SHM_DIR"] = str(shm)  # the file fallback: created and unlinked at once
    os.mkfifo(tmp_path / "fifo")
    before = {f for f in os.listdir("/dev/shm") if f.startswith("overlapckpt-")}
    root = tmp_path / "ckpts"
    child = subprocess.Popen(
        [sys.executable, os.path.join(os.path.dirname(__file__), "workers", "fault_script.py"), moment, str(root)],
        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
    )
    try:
        writer_pid = int(read_child_line(child, 120).split()[1])
        assert read_child_line(child, 120).strip() == f"at {moment}"
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
    assert exited_within(writer_pid, 30), "the writer outlived its training process"
    assert {f for f in os.listdir("/dev/shm") if f.startswith("overlapckpt-")} == before
    assert os.listdir(shm) == []
    listed = list_checkpoints(str(root)) if root.exists() else []
    assert [i.step for i in listed] == ([3] if moment == "mid-persist" else [])
    for info in listed:  # every listed checkpoint loads
        fresh, fresh_opt, _, _ = make_run(seed=3, width=512)
        load(info.path, fresh, fresh_opt)


def test_a_writer_killed_inside_its_replay_loses_that_checkpoint_and_lists_no_wrong_one(tmp_path, monkeypatch):
    # The writer replays a window into the shared slot in place, group by group. Killed
    # after one group's first step, the slot is neither the copy the log starts from nor
    # the version: its successor replayed the log again, and listed a checkpoint whose
    # group 0 was stepped twice. It is lost instead, and the next one commits exactly.
    from fakes import TRAINER_PID_ENV
    from fakes import AdamW as BlockingReplayAdamW

    fifo = tmp_path / "block.fifo"
    os.mkfifo(fifo)
    monkeypatch.setenv(BLOCK_FIFO_ENV, str(fifo))
    monkeypatch.setenv(BLOCK_ONCE_MARKER_ENV, str(tmp_path / "blocked-once"))
    monkeypatch.setenv(TRAINER_PID_ENV, str(os.getpid()))

    def run():
        model, _, sched, sampler = make_run()
        opt = BlockingReplayAdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.05 * s))
        return model, opt, sched, sampler

    twin_model, twin_opt, twin_sched, twin_sampler = run()
    twin = {}
    for it in range(1, 10):
        train_step(twin_model, twin_opt, twin_sched, twin_sampler)
        twin[it] = (copy.deepcopy(twin_model.state_dict()), copy.deepcopy(twin_opt.state_dict()))
    model, opt, sched, sampler = run()
    ckpt = Checkpointer(model, opt, tmp_path / "ckpts", window=3, consistency="replay", copier=CpuCopier())
    with pytest.warns(UserWarning, match=r"the writer process died .* a new one was started"):
        try:
            for it in range(1, 10):
                train_step(model, opt, sched, sampler)
                if it in (3, 6):
                    ckpt.request()
                ckpt.step()
                if it == 5:
                    read_fifo_line(str(fifo), timeout_s=120)  # the writer is inside the replay of version 5
                    _kill_writer(ckpt)
            infos = ckpt.wait(timeout_s=120)
        finally:
            ckpt.close(timeout_s=60)
    listed = list_checkpoints(str(tmp_path / "ckpts"))
    for info in listed:  # every listed checkpoint is the state it claims
        fresh, fresh_opt, _, _ = make_run(seed=5)
        load(str(tmp_path / "ckpts"), fresh, fresh_opt, step=info.step)
        assert_state_equal(*twin[info.step], fresh, fresh_opt)
    assert [i.step for i in listed] == [i.step for i in infos] == [8]
    assert ckpt.writer_restarts == 1 and engine_of(ckpt).parts.dispatcher.lost_mid_replay == 1


def test_a_writer_killed_between_the_commit_and_latest_does_not_stop_training(tmp_path, monkeypatch):
    # Its successor persists the checkpoint again and finds it committed: this run's own, of
    # this step, so a success (latest written, the commit answered). Before, the successor's
    # CheckpointExistsError reached the loop from optimizer.step().
    from fakes import DiesBeforeLatestStore

    monkeypatch.setenv(BLOCK_ONCE_MARKER_ENV, str(tmp_path / "died-once"))
    twin = twin_states(6)
    model, opt, sched, sampler = make_run()
    with pytest.warns(UserWarning, match=r"the writer process died .* a new one was started"):
        with Checkpointer(model, opt, tmp_path / "ckpts", store_class=DiesBeforeLatestStore) as ckpt:
            for it in range(1, 7):
                train_step(model, opt, sched, sampler)
                ckpt.step()
                if it in (3, 5):
                    ckpt.request()
                    ckpt.wait(timeout_s=120)
            assert ckpt.writer_restarts == 1
            assert [s["step"] for s in ckpt.stats] == [3, 5]
    assert (tmp_path / "died-once").exists()  # the precondition: it died there
    assert [i.step for i in list_checkpoints(str(tmp_path / "ckpts"))] == [3, 5]
    assert (tmp_path / "ckpts" / "latest").read_text().strip() == "step-000000005"
    fresh, fresh_opt, _, _ = make_run(seed=5)
    load(str(tmp_path / "ckpts"), fresh, fresh_opt, step=3)
    assert_state_equal(*twin[3], fresh, fresh_opt)


def test_a_writer_death_seen_right_before_an_update_starts_no_snapshot_there(tmp_path, monkeypatch):
    """A deferred replay request, and a writer death first seen at the update point (right before the update)
    that frees its slot (the checkpoint it was replaying is lost): the request started there, after that hook
    had logged the step's gradients, so its replay missed that step and a wrong checkpoint was listed (found by
    fault seed 50). It starts at the post-hook that follows instead."""
    from fakes import TRAINER_PID_ENV
    from fakes import AdamW as BlockingReplayAdamW

    fifo = tmp_path / "block.fifo"
    os.mkfifo(fifo)
    monkeypatch.setenv(BLOCK_FIFO_ENV, str(fifo))
    monkeypatch.setenv(BLOCK_ONCE_MARKER_ENV, str(tmp_path / "blocked-once"))
    monkeypatch.setenv(TRAINER_PID_ENV, str(os.getpid()))

    def run():
        model, _, sched, sampler = make_run()
        opt = BlockingReplayAdamW(model.parameters(), lr=1e-2)
        return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.05 * s)), sampler

    twin_model, twin_opt, twin_sched, twin_sampler = run()
    twin = {}
    for it in range(1, 11):
        train_step(twin_model, twin_opt, twin_sched, twin_sampler)
        twin[it] = (copy.deepcopy(twin_model.state_dict()), copy.deepcopy(twin_opt.state_dict()))
    model, opt, sched, sampler = run()
    # One slot: the second request is deferred behind the replay its writer hangs in.
    ckpt = Checkpointer(model, opt, tmp_path / "ckpts", window=3, consistency="replay", copier=CpuCopier(), max_inflight=1)
    with pytest.warns(UserWarning, match=r"the writer process died .* a new one was started"):
        try:
            for it in range(1, 11):
                train_step(model, opt, sched, sampler)
                if it == 3:
                    ckpt.request()  # version 5: its writer hangs inside the replay
                if it == 6:
                    ckpt.request()  # deferred: the slot holds version 5
                ckpt.step()
                if it == 5:
                    read_fifo_line(str(fifo), timeout_s=120)
                if it == 6:
                    assert engine_of(ckpt).parts.requests.pending
                    _kill_writer(ckpt)  # nothing reads the pipe until step 7's update point
            infos = ckpt.wait(timeout_s=120)
        finally:
            ckpt.close(timeout_s=60)
    assert ckpt.writer_restarts == 1 and engine_of(ckpt).parts.dispatcher.lost_mid_replay == 1
    # Started after step 7 (before the fix: after step 6, inside step 7's update point, so version 8, wrong).
    assert [i.step for i in infos] == [9]
    fresh, fresh_opt, _, _ = make_run(seed=5)
    load(infos[0].path, fresh, fresh_opt)
    assert_state_equal(*twin[9], fresh, fresh_opt)
