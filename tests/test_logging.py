"""The overlapckpt logger: a record per commit, a warning for a deferred and merged request, the metrics hook."""

from __future__ import annotations

import logging

from overlapckpt import Checkpointer

from helpers import make_run, train_step


def test_commit_info_merged_request_warning_and_on_commit(tmp_path, caplog):
    figures: list[dict] = []
    model, opt, sched, sampler = make_run()
    with caplog.at_level(logging.INFO, logger="overlapckpt"):
        # One slot: the second request is deferred and merged (two slots would start it at once).
        with Checkpointer(model, opt, tmp_path, window=3, consistency="replay", on_commit=figures.append, max_inflight=1) as ckpt:
            for it in range(1, 7):
                train_step(model, opt, sched, sampler)
                ckpt.step()
                if it in (3, 4, 5):  # 4 and 5 come while the window of 3 still holds the only host slot
                    ckpt.request()
            infos = ckpt.wait(timeout_s=120)
    # 3's window reaches version 5; 4 and 5 wait for its slot and are answered by one snapshot, started later.
    assert [i.step for i in infos] == [5, 6]
    messages = [(r.name, r.levelno, r.getMessage()) for r in caplog.records]
    commits = [m for name, level, m in messages if name == "overlapckpt.commits" and level == logging.INFO and m.startswith("committed")]
    assert len(commits) == 2 and commits[0].startswith("committed version 5 (requested after step 3, replay, window 3)")
    merged = [m for name, level, m in messages if name == "overlapckpt.requests" and level == logging.WARNING]
    assert len(merged) == 1, messages
    assert merged[0].startswith(
        "checkpoint requested after step 4 started at step 6 and holds version 8: the checkpoint requested after step 3 was "
        "still being copied (window 3)"
    )
    assert merged[0].endswith("; the requests after step(s) [5] were merged into it")
    assert [f["step"] for f in figures] == [5, 6]
    assert all(f["time_to_commit_s"] > 0 and f["state_bytes"] > 0 for f in figures)
    # The writer's split of persist_s (issue 29: where time to durable goes), flat for metrics sinks.
    laps = ["agree_and_replay", "snapshot_checksums", "write", "manifest", "commit"]
    parts = ["write_to_storage", "write_checksums", "write_writeback_hints", "write_fsync"]
    for f in figures:
        split = {k: v for k, v in f.items() if k.startswith("persist_") and k != "persist_s" and k != "persist_phases_s"}
        assert set(split) == {f"persist_{name}_s" for name in laps + parts}, split
        assert all(v >= 0 for v in split.values())
        assert sum(split[f"persist_{name}_s"] for name in laps) <= f["persist_s"]  # consecutive laps inside it
        assert split["persist_write_fsync_s"] > 0  # DCP fsynced the shard, and the stream saw it
    assert all(set(s["persist_phases_s"]) == set(laps) | {p.replace("write_", "write.", 1) for p in parts} for s in ckpt.stats)


def test_a_deferred_request_at_a_version_already_held_is_answered_by_it(tmp_path, caplog):
    """wait() right at the version an open window reaches: the deferred requests must not duplicate it."""
    model, opt, sched, sampler = make_run()
    with caplog.at_level(logging.WARNING, logger="overlapckpt"):
        with Checkpointer(model, opt, tmp_path, window=3, consistency="replay", max_inflight=1) as ckpt:  # one slot: deferred
            for it in range(1, 6):
                train_step(model, opt, sched, sampler)
                ckpt.step()
                if it in (3, 4, 5):
                    ckpt.request()
            infos = ckpt.wait(timeout_s=120)  # before the fix: CheckpointExistsError for a second version 5
    assert [i.step for i in infos] == [5]
    answered = [r.getMessage() for r in caplog.records if r.name == "overlapckpt.requests"]
    assert answered and answered[0].startswith("checkpoint requests after step(s) [4, 5] are answered by the checkpoint of version 5")
