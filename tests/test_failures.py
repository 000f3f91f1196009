"""The writer dies or storage fails: the error surfaces, nothing committed is lost."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time

import pytest
import torch

from overlapckpt import CheckpointWriteError, WriterDiedError, list_checkpoints, load
from overlapckpt.seams import Checkpointer, engine_of
from overlapckpt.train.copying.cpu_copier import CpuCopier

from fakes import BLOCK_FIFO_ENV, FAIL_AT_ENV, ONLY_NAME_ENV, BlockingStore, FailingStore
from helpers import TinyNet, assert_state_equal, make_run, read_fifo_line, snapshot, train_step

LIVENESS_BOUND_S = 10.0


def test_writer_killed_while_persisting(tmp_path, monkeypatch):
    fifo = str(tmp_path / "block.fifo")
    os.mkfifo(fifo)
    root = tmp_path / "ckpts"
    monkeypatch.setenv(ONLY_NAME_ENV, "step-000000004")
    monkeypatch.setenv(BLOCK_FIFO_ENV, fifo)
    model, opt, sched, sampler = make_run()
    # No restart: this is the path where a death is raised (tests/test_faults.py covers the
    # restarts). Copies at the call, so the snapshot is complete, and sent, at ckpt.step().
    ckpt = Checkpointer(model, opt, root, store_class=BlockingStore, max_writer_restarts=0, copier=CpuCopier())
    try:
        for _ in range(2):
            train_step(model, opt, sched, sampler)
        ckpt.request()
        ref = snapshot(model, opt)
        ckpt.wait(timeout_s=120)  # step 2 commits
        for _ in range(2):
            train_step(model, opt, sched, sampler)
        ckpt.request()  # step 4: the writer hangs in its first shard write
        ckpt.step()  # the iteration boundary: the snapshot is complete and goes to the writer
        pid = int(read_fifo_line(fifo, timeout_s=120))
        assert pid == ckpt.writer_pid
        os.kill(pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(WriterDiedError, match="SIGKILL"):
            ckpt.wait(timeout_s=60)
        assert time.monotonic() - started < LIVENESS_BOUND_S
        # Once raised, training may go on without checkpoints; asking for one raises again.
        train_step(model, opt, sched, sampler)
        with pytest.raises(WriterDiedError):
            ckpt.request()
    finally:
        ckpt.close(timeout_s=30)

    assert [i.step for i in list_checkpoints(str(root))] == [2]
    # The killed attempt wrote only its own directory, never the checkpoint's name.
    assert not (root / "step-000000004").exists()
    (leftover,) = root.glob("step-000000004.attempt-*")
    assert not (leftover / ".metadata").exists()
    assert (root / "latest").read_text() == "step-000000002"
    fresh_model, fresh_opt, _, _ = make_run(seed=3)
    assert load(str(root), fresh_model, fresh_opt).step == 2
    assert_state_equal(*ref, fresh_model, fresh_opt)


def _committed_step_one_with_failing_step_two(tmp_path, monkeypatch, fail_at: int):
    """A Checkpointer that has committed step 1; its store fails on write ``fail_at`` of step 2."""
    monkeypatch.setenv(FAIL_AT_ENV, str(fail_at))
    monkeypatch.setenv(ONLY_NAME_ENV, "step-000000002")
    run = make_run()
    ckpt = Checkpointer(run[0], run[1], tmp_path, store_class=FailingStore)
    train_step(*run)
    ckpt.request()
    ckpt.wait(timeout_s=120)
    return ckpt, run


# Writes of one checkpoint, in order: 1 the shard, 2 the manifest, 3 .metadata.tmp (the commit), 4 latest.
@pytest.mark.parametrize("fail_at", [1, 2, 3])
def test_storage_failure_leaves_no_commit(tmp_path, monkeypatch, fail_at):
    ckpt, (model, opt, sched, sampler) = _committed_step_one_with_failing_step_two(tmp_path, monkeypatch, fail_at)
    with ckpt:
        assert (tmp_path / "latest").read_text() == "step-000000001"
        train_step(model, opt, sched, sampler)
        ckpt.request()
        with pytest.raises(CheckpointWriteError, match="No space left on device.*the storage is full") as excinfo:
            ckpt.wait(timeout_s=120)
        assert isinstance(excinfo.value.__cause__, OSError)
        assert excinfo.value.__cause__.errno == 28
        # The writer survives a failed write: the next checkpoint commits.
        train_step(model, opt, sched, sampler)
        ckpt.request()
        assert [i.step for i in ckpt.wait(timeout_s=120)] == [3]
    assert not list(tmp_path.glob("step-000000002*"))  # the failed attempt's files were removed
    assert [i.step for i in list_checkpoints(str(tmp_path))] == [1, 3]


def test_failure_of_latest_update_keeps_previous_pointer(tmp_path, monkeypatch, caplog):
    ckpt, (model, opt, sched, sampler) = _committed_step_one_with_failing_step_two(tmp_path, monkeypatch, 4)
    with ckpt, caplog.at_level(logging.WARNING, logger="overlapckpt"):
        train_step(model, opt, sched, sampler)
        ckpt.request()
        # Committed before `latest` failed: a warning, never a failed persist.
        assert [i.step for i in ckpt.wait(timeout_s=120)] == [2]
    assert any("committed, but updating" in r.getMessage() and "No space left" in r.getMessage() for r in caplog.records)
    # .metadata committed step 2 before `latest` failed: it is a checkpoint, and the
    # newest one; `latest` still names step 1, a committed checkpoint.
    assert (tmp_path / "latest").read_text() == "step-000000001"
    assert [i.step for i in list_checkpoints(str(tmp_path))] == [1, 2]
    fresh_model, fresh_opt, _, _ = make_run(seed=3)
    assert load(str(tmp_path), fresh_model, fresh_opt, step=2).step == 2


def test_writer_killed_between_checkpoints_is_raised_at_a_hook(tmp_path):
    # Nothing is in flight, so the hooks do not read the pipe; a liveness check still finds it.
    # No restart allowed: the death itself is raised (tests/test_faults.py covers restarts).
    model, opt, sched, sampler = make_run()
    with Checkpointer(model, opt, tmp_path, max_writer_restarts=0) as ckpt:
        train_step(model, opt, sched, sampler)
        ckpt.request()
        ckpt.wait(timeout_s=120)
        assert engine_of(ckpt).parts.link.writer.awaiting_responses == 0  # precondition: idle, nothing due
        os.kill(ckpt.writer_pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        with pytest.raises(WriterDiedError, match=r"SIGKILL.*while no checkpoint was in flight"):
            while time.monotonic() < deadline:  # the kernel reaps it within a few steps
                train_step(model, opt, sched, sampler)
        steps_before = ckpt.step_count
        train_step(model, opt, sched, sampler)  # reported once; training goes on
        assert ckpt.step_count == steps_before + 1
        with pytest.raises(WriterDiedError):
            ckpt.request()
    assert [i.step for i in list_checkpoints(str(tmp_path))] == [1]


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real, small file system: 128 KiB of tmpfs, which one checkpoint of TinyNet fits and two do not."""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=128k", "tmpfs", str(mount_point)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}); the ENOSPC store tests above cover the logic")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def _used_bytes(path) -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def test_disk_full_inside_a_tensors_serialization_names_the_full_storage(small_tmpfs):
    """The file system fills up inside torch.save's zip writer, which calls our stream from C++ and
    loses the OSError: it used to surface as "RuntimeError ... unexpected pos 704 vs 598"."""
    torch.manual_seed(0)
    model = TinyNet(width=300, features=64, outputs=64)  # about 190 KiB of shard: more than the 128 KiB
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    with Checkpointer(model, opt, small_tmpfs / "ckpts") as ckpt:
        ckpt.request()
        with pytest.raises(CheckpointWriteError, match=r"OSError: \[Errno 28\] No space left on device; the storage is full") as excinfo:
            ckpt.wait(timeout_s=120)
        assert "unexpected pos" not in str(excinfo.value).splitlines()[0]
        assert getattr(excinfo.value.__cause__, "errno", None) == 28
    assert not [p for p in (small_tmpfs / "ckpts").iterdir() if p.name.startswith("step-")]
    assert list_checkpoints(str(small_tmpfs / "ckpts")) == []


def test_disk_full_on_a_real_file_system_frees_the_attempt_and_recovers(small_tmpfs):
    model, opt, sched, sampler = make_run()
    with Checkpointer(model, opt, small_tmpfs / "ckpts") as ckpt:
        train_step(model, opt, sched, sampler)
        ckpt.request()
        assert [i.step for i in ckpt.wait(timeout_s=120)] == [1]
        used_after_one = _used_bytes(small_tmpfs)
        train_step(model, opt, sched, sampler)
        ckpt.request()
        with pytest.raises(CheckpointWriteError, match="the storage is full") as excinfo:
            ckpt.wait(timeout_s=120)
        assert getattr(excinfo.value.__cause__, "errno", None) == 28
        assert not list((small_tmpfs / "ckpts").glob("step-000000002*"))
        assert _used_bytes(small_tmpfs) == used_after_one  # the partial shard's space was freed
        subprocess.run(["mount", "-o", "remount,size=4m", str(small_tmpfs)], check=True)  # space is back
        train_step(model, opt, sched, sampler)
        ckpt.request()
        assert [i.step for i in ckpt.wait(timeout_s=120)] == [3]
    assert [i.step for i in list_checkpoints(str(small_tmpfs / "ckpts"))] == [1, 3]
