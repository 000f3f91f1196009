"""Retention and latest follow the run's lineage: a rollback loses nothing, odd names break nothing."""

from __future__ import annotations

import json
import logging
import os
import warnings

import pytest

from overlapckpt import Checkpointer, list_checkpoints, load
from overlapckpt.cli import main

from fakes import RETENTION_GATE_ENV, FailingRetentionStore, GatedRetentionStore
from helpers import StatefulSampler, assert_state_equal, make_run, snapshot, train_step


def _names(root) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith("step-"))


def _train(ckpt, model, opt, sched, sampler, steps: int, request_at: tuple[int, ...]) -> None:
    for _ in range(steps):
        train_step(model, opt, sched, sampler)
        ckpt.step()
        if ckpt.step_count in request_at:
            ckpt.request()
            ckpt.wait(timeout_s=120)


def test_a_rollback_keeps_the_fresh_checkpoint_and_the_abandoned_ones(tmp_path, caplog):
    model, opt, sched, sampler = make_run()
    with Checkpointer(model, opt, tmp_path, stateful={"sched": sched}) as ckpt:
        _train(ckpt, model, opt, sched, sampler, 4, (2, 4))
    assert _names(tmp_path) == ["step-000000002", "step-000000004"]  # run 1

    model, opt, sched, sampler = make_run(seed=3)
    with caplog.at_level(logging.WARNING, logger="overlapckpt"):
        with Checkpointer(model, opt, tmp_path, keep=1, stateful={"sched": sched}) as ckpt:
            assert ckpt.restore(step=2).step == 2  # the rollback
            run2 = ckpt._lineage.run_id
            _train(ckpt, model, opt, sched, sampler, 1, (3,))
            assert (tmp_path / "latest").read_text() == "step-000000003"
            assert "step-000000003" in _names(tmp_path)  # not deleted by this run's keep=1
            assert load(str(tmp_path), *make_run(seed=9)[:2]).step == 3  # latest, not the abandoned 4
            # Version 4 is held by run 1's checkpoint: this run's gets a lineage-aware name.
            _train(ckpt, model, opt, sched, sampler, 1, (4,))
    named = [r.getMessage() for r in caplog.records if "newer checkpoints exist" in r.getMessage()]
    assert named and "step-000000004" in named[0]
    mine = f"step-000000004-{run2[:8]}"
    # keep=1 counts the lineage: it removed this run's own step 3 and, once this run had committed a
    # newer one, the restore point (run 1's step 2); never run 1's abandoned step 4.
    assert _names(tmp_path) == ["step-000000004", mine]
    assert (tmp_path / "latest").read_text() == mine
    info = load(str(tmp_path), *make_run(seed=9)[:2])
    assert info.path.endswith(mine) and info.run_id == run2
    assert {i.run_id for i in list_checkpoints(str(tmp_path))} == {run2, json.loads((tmp_path / "step-000000004" / "overlapckpt.json").read_text())["run_id"]}


def test_odd_directory_names_break_neither_listing_nor_retention(tmp_path, capsys):
    for odd in ("step-²", "step-12x", "step-000000001-NOTHEX", "step-"):
        (tmp_path / odd).mkdir(parents=True)
        (tmp_path / odd / ".metadata").write_bytes(b"")
    model, opt, sched, sampler = make_run()
    with Checkpointer(model, opt, tmp_path, keep=1) as ckpt:
        _train(ckpt, model, opt, sched, sampler, 3, (1, 2, 3))
    assert [i.step for i in list_checkpoints(str(tmp_path))] == [3]
    assert main(["ls", str(tmp_path)]) == 0
    assert "step-000000003" in capsys.readouterr().out
    assert all((tmp_path / odd).exists() for odd in ("step-²", "step-12x"))  # not ours: left alone


def test_a_failure_after_the_commit_is_a_warning(tmp_path, caplog):
    model, opt, sched, sampler = make_run()
    with caplog.at_level(logging.WARNING, logger="overlapckpt"):
        with Checkpointer(model, opt, tmp_path, keep=1, store_class=FailingRetentionStore) as ckpt:
            _train(ckpt, model, opt, sched, sampler, 2, (1, 2))
            assert [s["step"] for s in ckpt.stats] == [1, 2]  # both committed, neither failed
    assert any("retention (keep=1) failed" in r.getMessage() and "OSError" in r.getMessage() for r in caplog.records)
    assert _names(tmp_path) == ["step-000000001", "step-000000002"]


def test_a_commit_is_answered_before_retention_deletes_anything(tmp_path, monkeypatch):
    # Deleting the oldest checkpoints (hundreds of MiB each) took 0.3 s of a 768 MiB
    # checkpoint's 1.4 s to durable when it ran before the commit's answer (issue 29).
    gate = tmp_path / "gate"
    os.mkfifo(gate)
    monkeypatch.setenv(RETENTION_GATE_ENV, str(gate))
    root = tmp_path / "ckpts"
    model, opt, sched, sampler = make_run()
    with Checkpointer(model, opt, root, keep=1, store_class=GatedRetentionStore) as ckpt:
        try:
            _train(ckpt, model, opt, sched, sampler, 2, (1, 2))  # waits for each commit, 120 s at most
            # Step 2 is answered while step 1's bytes wait at the gate, retired already: no longer
            # listed, no longer a step directory, its shard still on disk.
            assert [s["step"] for s in ckpt.stats] == [1, 2]
            assert [i.step for i in list_checkpoints(str(root))] == [2]
            assert _names(root) == ["step-000000002"]
            (retired,) = [n for n in os.listdir(root) if n.startswith(".retired-step-000000001-")]
            assert (root / retired / "__0_0.distcp").exists()
        finally:
            with open(gate, "wb") as opened:  # the writer holds its end open: this does not block
                opened.write(b"x")
    # close() waited for the writer, which deleted it first.
    assert sorted(os.listdir(root)) == ["latest", "step-000000002"]


def _run_1(root) -> dict[int, tuple]:
    """Checkpoints at steps 2 and 4 of run 1; its state at each step."""
    from helpers import snapshot

    model, opt, sched, sampler = make_run()
    states = {}
    with Checkpointer(model, opt, root, stateful={"sched": sched}) as ckpt:
        for s in range(1, 5):
            train_step(model, opt, sched, sampler)
            states[s] = snapshot(model, opt)
            ckpt.step()
            if s in (2, 4):
                ckpt.request()
                ckpt.wait(timeout_s=120)
    return states


def test_a_checkpointer_built_after_load_continues_that_checkpoints_count(tmp_path, recwarn):
    # The README's resume: load() into fresh objects, then a Checkpointer on the same root.
    # Before, the count started over: the next checkpoint was step-000000001, of version 3.
    from helpers import assert_state_equal, snapshot

    _run_1(tmp_path)
    model, opt, sched, sampler = make_run(seed=3)
    train_step(model, opt, sched, sampler)  # the state load() reads into
    assert load(str(tmp_path), model, opt, stateful={"sched": sched}, step=2).step == 2
    with Checkpointer(model, opt, tmp_path, keep=1, stateful={"sched": sched}) as ckpt:
        assert ckpt.step_count == 2
        train_step(model, opt, sched, sampler)
        expected = snapshot(model, opt)
        ckpt.step()
        ckpt.request()
        (info,) = ckpt.wait(timeout_s=120)
        run2 = ckpt._lineage.run_id
    assert info.step == 3 and os.path.basename(info.path) == "step-000000003"
    # keep=1 counts the lineage: the restore point (step-2) went once step-3 committed; the older
    # run's newer step-4, a trajectory this one abandoned, stays; latest names ours.
    assert _names(tmp_path) == ["step-000000003", "step-000000004"]
    with open(tmp_path / "step-000000003" / "overlapckpt.json") as f:
        manifest = json.load(f)
    assert manifest["run_id"] == run2 and manifest["restored_from"] == "step-000000002"
    assert (tmp_path / "latest").read_text().strip() == "step-000000003"
    fresh, fresh_opt, _, _ = make_run(seed=5)
    train_step(fresh, fresh_opt, *make_run(seed=5)[2:])
    assert load(str(tmp_path), fresh, fresh_opt).step == 3
    assert_state_equal(*expected, fresh, fresh_opt)
    assert not [w for w in recwarn if "as if training had started over" in str(w.message)]


def test_a_run_that_stepped_after_load_or_never_loaded_is_warned_once_with_the_call_to_continue(tmp_path):
    import pytest

    _run_1(tmp_path)
    model, opt, sched, sampler = make_run(seed=3)
    train_step(model, opt, sched, sampler)
    load(str(tmp_path), model, opt, step=2)
    train_step(model, opt, sched, sampler)  # a step after the load: the state is no longer version 2
    with Checkpointer(model, opt, tmp_path) as ckpt:
        assert ckpt.step_count == 0
        with pytest.warns(UserWarning) as caught:
            for _ in range(2):
                train_step(model, opt, sched, sampler)
                ckpt.step()
                ckpt.request()
                ckpt.wait(timeout_s=120)
    ahead = [str(w.message) for w in caught if "as if training had started over" in str(w.message)]
    assert len(ahead) == 1, ahead  # once, though two checkpoints were named below version 4
    assert "checkpoint of version 1" in ahead[0] and "up to version 4 (the newest: 2, 4)" in ahead[0]
    assert "load(root, model, optimizer)" in ahead[0] and "ckpt.continued_from(<version>)" in ahead[0]


def test_retention_follows_versions_when_the_writers_clock_steps_back(tmp_path):
    # step-3's manifest says it was written an hour before step-1: ordered by created_at,
    # keep=2 deleted the newer step-3.
    from fakes import SkewedClockStore

    model, opt, sched, sampler = make_run()
    created = {}
    with Checkpointer(model, opt, tmp_path, keep=2, store_class=SkewedClockStore) as ckpt:
        for _ in range(5):
            train_step(model, opt, sched, sampler)
            ckpt.step()
            ckpt.request()
            (info,) = ckpt.wait(timeout_s=120)
            with open(os.path.join(info.path, "overlapckpt.json")) as f:
                created[info.step] = json.load(f)["created_at"]
            # keep=2: this run's two newest versions, whatever their manifests' clocks say.
            assert _names(tmp_path) == [f"step-{v:09d}" for v in range(max(1, info.step - 1), info.step + 1)], info.step
    assert created[3] < created[1] - 3000  # the precondition: the clock stepped back
    assert _names(tmp_path) == ["step-000000004", "step-000000005"]


def test_latest_left_behind_by_a_crash_resolves_to_the_newest_of_its_run(tmp_path):
    # A whole-job crash after step-6's commit and before latest was updated: latest still
    # names step-4. load() resumed step 4 silently; it takes step 6, and says why.
    import pytest

    from helpers import assert_state_equal, snapshot

    model, opt, sched, sampler = make_run()
    states = {}
    with Checkpointer(model, opt, tmp_path) as ckpt:
        for s in range(1, 7):
            train_step(model, opt, sched, sampler)
            states[s] = snapshot(model, opt)
            ckpt.step()
            if s % 2 == 0:
                ckpt.request()
                ckpt.wait(timeout_s=120)
    (tmp_path / "latest").write_text("step-000000004\n")  # what the crash left
    fresh, fresh_opt, _, _ = make_run(seed=5)
    train_step(fresh, fresh_opt, *make_run(seed=5)[2:])
    with pytest.warns(UserWarning, match=r"latest names step-000000004 \(version 4\), but its run also committed step-000000006"):
        assert load(str(tmp_path), fresh, fresh_opt).step == 6
    assert_state_equal(*states[6], fresh, fresh_opt)
    assert load(str(tmp_path), fresh, fresh_opt, step=4).step == 4  # the one latest names, when asked for


def test_a_rollback_inside_one_checkpointer_starts_a_new_lineage(tmp_path):
    """every=1, keep=3, six steps, restore(step=4), three steps on other data. Before: no warning about 5 and 6,
    the new trajectory's versions 5 and 6 were never checkpointed (counted as held), load(step=5) returned the
    abandoned trajectory, and retention deleted step-4, the restore point."""
    model, opt, sched, sampler = make_run()
    with Checkpointer(model, opt, tmp_path, every=1, keep=3, stateful={"sched": sched}) as ckpt:
        for _ in range(6):
            train_step(model, opt, sched, sampler)
            ckpt.step()
            ckpt.wait(timeout_s=120)  # each step's checkpoint commits before the next is due: none merged
        assert _names(tmp_path) == ["step-000000004", "step-000000005", "step-000000006"]
        first_run = ckpt._lineage.run_id
        with pytest.warns(UserWarning, match=r"restored step-000000004 \(version 4\) after this run committed step-000000005, step-000000006"):
            assert ckpt.restore(step=4).step == 4
        second_run = ckpt._lineage.run_id
        assert second_run != first_run
        other_data = StatefulSampler(seed=777)
        states, committed = {}, []
        for _ in range(3):
            train_step(model, opt, sched, other_data)
            ckpt.step()
            states[ckpt.step_count] = snapshot(model, opt)
            committed += ckpt.wait(timeout_s=120)
    mine = second_run[:8]
    assert [i.step for i in committed] == [5, 6, 7]  # the new trajectory's versions are all checkpointed
    # keep=3 counts the lineage: the restore point survived until three newer ones committed; the
    # abandoned trajectory (5 and 6 of the first run) survives.
    assert _names(tmp_path) == [
        "step-000000005", f"step-000000005-{mine}", "step-000000006", f"step-000000006-{mine}", "step-000000007",
    ]
    assert (tmp_path / "latest").read_text() == "step-000000007"
    for step in (5, 6, 7):
        fresh_model, fresh_opt, _, _ = make_run(seed=9)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            info = load(str(tmp_path), fresh_model, fresh_opt, step=step)
        assert info.run_id == second_run, step  # the run latest names, not the abandoned trajectory
        assert_state_equal(*states[step], fresh_model, fresh_opt)
        if step < 7:
            assert any(f"holds 2 checkpoints of step {step}" in str(w.message) and "of the run latest names" in str(w.message) for w in caught)


def test_a_final_save_right_after_a_restore_writes_no_duplicate(tmp_path):
    """A framework's final save after a resume that trained nothing (Lightning's on_train_end, the Trainer's
    on_train_end) requests the restored version: before, it wrote a duplicate step-000000002-<run>."""
    model, opt, sched, sampler = make_run()
    with Checkpointer(model, opt, tmp_path) as ckpt:
        _train(ckpt, model, opt, sched, sampler, 2, (2,))
    model, opt, sched, sampler = make_run(seed=3)
    with Checkpointer(model, opt, tmp_path) as ckpt:
        assert ckpt.restore().step == 2
        ckpt.request()  # nothing trained since: the restored checkpoint holds this version
        assert ckpt.wait(timeout_s=120) == []
        _train(ckpt, model, opt, sched, sampler, 1, (3,))  # a real step after it is checkpointed as usual
    assert _names(tmp_path) == ["step-000000002", "step-000000003"]
