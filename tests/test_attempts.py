"""Unique attempts: a second job on one root never truncates a committed shard nor deletes an attempt in progress.

The two jobs are two stores with two run ids writing real DCP checkpoints through
``CheckpointStore.make_writer``, interleaved by hand at the points that raced before:
job B starting while A's attempt is in progress, and B writing after A committed.
"""

from __future__ import annotations

import hashlib
import json

import pytest
import s3fs
import torch
import torch.distributed.checkpoint as dcp

from overlapckpt.errors import CheckpointExistsError
from overlapckpt.format.attempts import CLAIM_NAME, Attempt, new_attempt_id
from overlapckpt.format.manifest import MANIFEST_NAME
from overlapckpt.format.storage import CheckpointStore

NAME = "step-000000005"
RUN_A = "a" * 16
RUN_B = "b" * 16
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 64, generator=g), "b": torch.randn(64, generator=g)}


def _write(store: CheckpointStore, attempt: Attempt, state: dict[str, torch.Tensor]) -> None:
    """What the writer does between begin and publish: shards, the manifest right before .metadata, .metadata."""

    def write_manifest(sums) -> None:
        store.write_manifest(attempt.directory, json.dumps({"run_id": attempt.run_id}).encode())

    dcp.save(state, storage_writer=store.make_writer(attempt.directory, before_commit=write_manifest), no_dist=True)


def _digests(fs, directory: str) -> dict[str, str]:
    fs.invalidate_cache()
    return {p.rsplit("/", 1)[-1]: hashlib.sha256(fs.cat_file(p)).hexdigest() for p in fs.find(directory)}


def _load(url: str, storage_options=None) -> dict[str, torch.Tensor]:
    store = CheckpointStore(url.rsplit("/", 1)[0], storage_options)
    out = {"w": torch.zeros(64, 64), "b": torch.zeros(64)}
    dcp.load(out, storage_reader=store.make_reader(url.rsplit("/", 1)[1]), no_dist=True)
    return out


def test_local_second_job_never_touches_the_first_jobs_attempt_or_commit(tmp_path):
    job_a, job_b = CheckpointStore(str(tmp_path)), CheckpointStore(str(tmp_path))
    a = Attempt(job_a, NAME, RUN_A, new_attempt_id(RUN_A))
    a.begin()
    _write(job_a, a, _state(1))
    in_progress = _digests(job_a.fs, str(tmp_path / a.directory))

    # B starts on the same name while A's attempt is in progress (before: it cleared A's directory).
    b = Attempt(job_b, NAME, RUN_B, new_attempt_id(RUN_B))
    b.begin()
    assert b.directory != a.directory
    _write(job_b, b, _state(2))
    assert _digests(job_a.fs, str(tmp_path / a.directory)) == in_progress

    a.publish()
    assert _digests(job_a.fs, str(tmp_path / NAME)) == in_progress
    # B's commit is refused by name, and B's own files go; A's committed shards are untouched
    # (before: B reopened A's __0_0.distcp with "wb").
    with pytest.raises(CheckpointExistsError, match=f"{NAME} is already committed"):
        b.publish()
    b.abandon()
    assert not (tmp_path / b.directory).exists()
    assert _digests(job_a.fs, str(tmp_path / NAME)) == in_progress
    loaded = _load(str(tmp_path / NAME))
    assert all(torch.equal(loaded[k], v) for k, v in _state(1).items())

    # A third attempt after the commit is refused before it writes anything.
    c = Attempt(job_b, NAME, RUN_B, new_attempt_id(RUN_B))
    with pytest.raises(CheckpointExistsError, match="already committed"):
        c.begin()
    assert sorted(p.name for p in tmp_path.iterdir()) == [NAME]
    assert job_b.committed_names() == [NAME]


def test_local_dead_attempts_are_swept_by_their_run_and_under_the_lease(tmp_path):
    store = CheckpointStore(str(tmp_path))
    mine = Attempt(store, "step-000000001", RUN_A, new_attempt_id(RUN_A))
    theirs = Attempt(store, "step-000000002", RUN_B, new_attempt_id(RUN_B))
    for dead, seed in ((mine, 1), (theirs, 2)):
        dead.begin()
        _write(store, dead, _state(seed))  # then killed before publish
    unrelated = tmp_path / "step-000000003.attempt-notours"  # not an attempt name: never touched
    unrelated.mkdir()

    Attempt(store, "step-000000004", RUN_A, new_attempt_id(RUN_A)).begin()  # not leased: only this run's
    assert not (tmp_path / mine.directory).exists()
    assert (tmp_path / theirs.directory).exists()

    Attempt(store, "step-000000006", RUN_A, new_attempt_id(RUN_A), root_leased=True).begin()
    assert not (tmp_path / theirs.directory).exists()
    assert unrelated.exists()
    assert store.committed_names() == []


def test_local_publish_replaces_only_an_uncommitted_leftover(tmp_path):
    store = CheckpointStore(str(tmp_path))
    leftover = tmp_path / NAME
    leftover.mkdir()
    (leftover / "__0_0.distcp").write_bytes(b"half a shard")  # no .metadata: not a checkpoint
    a = Attempt(store, NAME, RUN_A, new_attempt_id(RUN_A))
    a.begin()
    _write(store, a, _state(3))
    a.publish()
    loaded = _load(str(tmp_path / NAME))
    assert all(torch.equal(loaded[k], v) for k, v in _state(3).items())
    assert json.loads((tmp_path / NAME / MANIFEST_NAME).read_text()) == {"run_id": RUN_A}


def test_s3_attempts_claim_the_name_before_writing(s3_options):
    root = "s3://ckpts/attempts"
    job_a, job_b = CheckpointStore(root, s3_options), CheckpointStore(root, s3_options)
    fs = s3fs.S3FileSystem(**s3_options)
    a = Attempt(job_a, NAME, RUN_A, new_attempt_id(RUN_A))
    a.begin()
    job_a.write_bytes(NAME, "__0_0.distcp", b"a shard being written")  # in progress: no .metadata yet
    in_progress = _digests(fs, f"ckpts/attempts/{NAME}")
    assert sorted(in_progress) == [CLAIM_NAME, "__0_0.distcp"]

    # Another job, without the root's lease, is refused by name and writes nothing.
    b = Attempt(job_b, NAME, RUN_B, new_attempt_id(RUN_B))
    with pytest.raises(CheckpointExistsError, match=f"being written by attempt {a.attempt_id} of run {RUN_A}"):
        b.begin()
    assert _digests(fs, f"ckpts/attempts/{NAME}") == in_progress

    _write(job_a, a, _state(1))  # on an object store DCP's .metadata is the commit, in place
    a.publish()  # the claim goes once committed
    committed = _digests(fs, f"ckpts/attempts/{NAME}")
    assert sorted(committed) == [".metadata", "__0_0.distcp", MANIFEST_NAME]
    with pytest.raises(CheckpointExistsError, match="already committed"):
        Attempt(job_b, NAME, RUN_B, new_attempt_id(RUN_B), root_leased=True).begin()
    assert _digests(fs, f"ckpts/attempts/{NAME}") == committed
    loaded = _load(f"{root}/{NAME}", s3_options)
    assert all(torch.equal(loaded[k], v) for k, v in _state(1).items())


def test_s3_dead_claims_are_taken_over_only_when_provably_dead(s3_options):
    root = "s3://ckpts/attempts-dead"
    store = CheckpointStore(root, s3_options)
    fs = s3fs.S3FileSystem(**s3_options)
    name = "step-000000007"
    dead = Attempt(store, name, RUN_B, new_attempt_id(RUN_B))
    dead.begin()
    _write(store, dead, {"w": torch.ones(64, 64), "b": torch.ones(64)})
    fs.rm(f"ckpts/attempts-dead/{name}/.metadata")  # killed right before its commit

    with pytest.raises(CheckpointExistsError, match="being written by"):
        Attempt(store, name, RUN_A, new_attempt_id(RUN_A)).begin()
    # The same run's restarted writer takes its own dead attempt over.
    again = Attempt(store, name, RUN_B, new_attempt_id(RUN_B))
    again.begin()
    fs.invalidate_cache()
    assert [p.rsplit("/", 1)[-1] for p in fs.find(f"ckpts/attempts-dead/{name}")] == [CLAIM_NAME]
    claim = json.loads(fs.cat_file(f"ckpts/attempts-dead/{name}/{CLAIM_NAME}"))
    assert claim["attempt"] == again.attempt_id
    again.abandon()
    fs.invalidate_cache()
    assert not fs.exists(f"ckpts/attempts-dead/{name}")

    # Another run's dead attempt is taken over while this run holds the root's lease.
    dead.begin()
    leased = Attempt(store, name, RUN_A, new_attempt_id(RUN_A), root_leased=True)
    leased.begin()
    _write(store, leased, _state(4))
    leased.publish()
    loaded = _load(f"{root}/{name}", s3_options)
    assert all(torch.equal(loaded[k], v) for k, v in _state(4).items())
