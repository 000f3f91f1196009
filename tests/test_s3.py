"""S3 round trip against a real S3-compatible server (moto) on 127.0.0.1."""

from __future__ import annotations

import s3fs

from overlapckpt import Checkpointer, list_checkpoints, load

from helpers import assert_state_equal, make_run, snapshot, train_step


def test_s3_save_list_load_retention(s3_options):
    url = "s3://ckpts/run-a"
    model, opt, sched, sampler = make_run()
    refs = {}
    with Checkpointer(model, opt, url, keep=2, storage_options=s3_options, stateful={"sampler": sampler}) as ckpt:
        for step in range(1, 5):
            train_step(model, opt, sched, sampler)
            ckpt.request()
            refs[step] = snapshot(model, opt)
            ckpt.step()
            ckpt.wait(timeout_s=120)
    infos = list_checkpoints(url, storage_options=s3_options)
    assert [i.step for i in infos] == [3, 4]
    assert infos[-1].path == "s3://ckpts/run-a/step-000000004"

    fs = s3fs.S3FileSystem(**s3_options)
    fs.invalidate_cache()
    assert fs.cat_file("ckpts/run-a/latest") == b"step-000000004"
    assert not fs.exists("ckpts/run-a/step-000000002/.metadata")
    assert fs.exists("ckpts/run-a/step-000000004/overlapckpt.json")
    assert not fs.exists("ckpts/run-a/step-000000004/.overlapckpt-attempt")  # the attempt's claim goes at the commit

    fresh_model, fresh_opt, _, fresh_sampler = make_run(seed=11)
    info = load(url, fresh_model, fresh_opt, stateful={"sampler": fresh_sampler}, storage_options=s3_options)
    assert info.step == 4 and fresh_sampler.position == 4
    assert_state_equal(*refs[4], fresh_model, fresh_opt)
    info3 = load(url, fresh_model, fresh_opt, step=3, storage_options=s3_options)
    assert info3.step == 3
    assert_state_equal(*refs[3], fresh_model, fresh_opt)


def test_s3_uncommitted_prefix_is_not_listed(s3_options):
    url = "s3://ckpts/run-b"
    model, opt, sched, sampler = make_run()
    with Checkpointer(model, opt, url, storage_options=s3_options) as ckpt:
        train_step(model, opt, sched, sampler)
        ckpt.request()
        ckpt.wait(timeout_s=120)
    fs = s3fs.S3FileSystem(**s3_options)
    # What a writer killed right before its commit leaves: the real shards and a real, valid
    # manifest, and no .metadata. Only the missing commit marker keeps it off the list.
    # (Under its own name, in another root: files copied under another step's name are now
    # refused for that alone, since a checkpoint's name is bound to its manifest.)
    other = "s3://ckpts/run-b-copy"
    for name in ("__0_0.distcp", "overlapckpt.json"):
        fs.copy(f"ckpts/run-b/step-000000001/{name}", f"ckpts/run-b-copy/step-000000001/{name}")
    assert [i.step for i in list_checkpoints(url, storage_options=s3_options)] == [1]
    assert [i.step for i in list_checkpoints(other, storage_options=s3_options)] == []
    # The control: the same files with the marker are listed, so the test can fail.
    fs.copy("ckpts/run-b/step-000000001/.metadata", "ckpts/run-b-copy/step-000000001/.metadata")
    assert [i.step for i in list_checkpoints(other, storage_options=s3_options)] == [1]
