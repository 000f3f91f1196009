"""One root, one job: the lease on a root, locally (O_EXCL) and on S3 (a conditional PUT)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from overlapckpt import Checkpointer
from overlapckpt.errors import RootLeaseError

from helpers import make_run, train_step

LEASE = ".overlapckpt-lease"


def test_a_second_job_on_the_same_root_is_refused_naming_the_holder(tmp_path):
    model, opt, sched, sampler = make_run()
    with Checkpointer(model, opt, tmp_path) as first:
        holder = json.loads((tmp_path / LEASE).read_text())
        assert holder["run_id"] == first._lineage.run_id
        other = make_run(seed=1)
        with pytest.raises(RootLeaseError, match=rf"is leased by run {holder['run_id']} \(pid {holder['pid']} on "):
            Checkpointer(other[0], other[1], tmp_path)
        train_step(model, opt, sched, sampler)
        first.request()
        assert [i.step for i in first.wait(timeout_s=120)] == [1]  # the refused one disturbed nothing
    assert not (tmp_path / LEASE).exists()  # released at close
    with Checkpointer(*make_run(seed=2)[:2], tmp_path):  # the root is free again
        assert (tmp_path / LEASE).exists()


def test_a_lease_left_by_a_dead_process_is_taken_over(tmp_path):
    code = (
        "import os, sys; sys.path[:0] = sys.argv[1:3]; from helpers import make_run; from overlapckpt import Checkpointer;"
        "m, o, _, _ = make_run(); Checkpointer(m, o, sys.argv[3]); os._exit(0)"  # dies holding the lease
    )
    import os

    here = os.path.dirname(__file__)
    subprocess.run([sys.executable, "-c", code, os.path.dirname(here), here, str(tmp_path)], check=True, timeout=120)
    stale = json.loads((tmp_path / LEASE).read_text())
    with Checkpointer(*make_run()[:2], tmp_path) as ckpt:
        assert json.loads((tmp_path / LEASE).read_text())["run_id"] == ckpt._lineage.run_id != stale["run_id"]


def test_a_lease_held_on_another_host_is_refused_with_the_fix(tmp_path):
    (tmp_path / LEASE).write_text(json.dumps({"pid": 1, "host": "node-17", "run_id": "feedfacecafebeef", "since_unix_s": 0}))
    with pytest.raises(RootLeaseError, match=rf"pid 1 on node-17.*once that job is known to be gone, delete {tmp_path}/{LEASE}"):
        Checkpointer(*make_run()[:2], tmp_path)


def test_the_lease_on_s3_is_a_conditional_put(s3_options):
    root = "s3://ckpts/lease-run"
    with Checkpointer(*make_run()[:2], root, storage_options=s3_options):
        with pytest.raises(RootLeaseError, match="one root, one job"):
            Checkpointer(*make_run(seed=1)[:2], root, storage_options=s3_options)
