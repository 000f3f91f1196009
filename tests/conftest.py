from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

# CPU training's copier runs on the CUDA emulation in the tests (garbage in fresh allocations, freed
# memory reused at once, CUDA's error codes), and in their subprocesses, which inherit this; the
# plain CPU device that CPU training runs by default is tested end to end in test_cpu_device.py.
os.environ.setdefault("OVERLAPCKPT_CPU_DEVICE", "emulated")


def pytest_collection_modifyitems(config, items):
    # "gpu": needs real hardware. "device": runs on CUDA where there is one, else on the
    # emulated device (tests/gpu_support.py), so it runs in make test.
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=["emulated", "plain"])
def cpu_device(request, monkeypatch):
    """An end-to-end CPU test on both CPU backends: the tests' CUDA emulation and the plain device CPU training runs."""
    monkeypatch.setenv("OVERLAPCKPT_CPU_DEVICE", request.param)
    return request.param


@pytest.fixture(scope="session")
def rig():
    """The device the GPU tests run on: CUDA, or the emulated one."""
    from gpu_support import current_rig

    return current_rig()


@pytest.fixture(scope="session")
def s3_server():
    """A real S3-compatible server (moto) on 127.0.0.1, with a bucket."""
    pytest.importorskip("s3fs")
    from moto.server import ThreadedMotoServer

    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        os.environ.setdefault(var, "testing")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server._server.server_address
    url = f"http://{host}:{port}"
    import boto3

    boto3.client("s3", endpoint_url=url, region_name="us-east-1", aws_access_key_id="testing", aws_secret_access_key="testing").create_bucket(Bucket="ckpts")
    yield url
    server.stop()


@pytest.fixture
def s3_options(s3_server):
    return {"key": "testing", "secret": "testing", "endpoint_url": s3_server, "client_kwargs": {"region_name": "us-east-1"}}


def pytest_addoption(parser):
    parser.addoption("--gpu-report", default=None, help="write the replay-vs-twin error report (JSON) here")
    parser.addoption(
        "--per-test-timeout-s", type=float, default=None,
        help="fail a test that runs longer than this (SIGALRM in the main thread); the next test still runs",
    )
    parser.addoption("--results-jsonl", default=None, help="append one JSON line per test outcome here, as each one ends")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """The per-test timeout (benchmarks/gpu.sh): a test that hangs loses itself, not the rest of the run."""
    import signal

    timeout_s = item.config.getoption("--per-test-timeout-s")
    if not timeout_s:
        yield
        return

    def expired(signum, frame):
        raise TimeoutError(f"{item.nodeid} ran past --per-test-timeout-s={timeout_s}")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def pytest_runtest_logreport(report):
    """Each outcome written as it comes, so a run cut short keeps every result before the cut."""
    import json

    path = _RESULTS_JSONL[0]
    if path is None or (report.when != "call" and report.outcome == "passed"):
        return
    with open(path, "a") as f:
        f.write(json.dumps({"test": report.nodeid, "when": report.when, "outcome": report.outcome, "duration_s": round(report.duration, 3)}) + "\n")
        f.flush()
        os.fsync(f.fileno())


_RESULTS_JSONL: list[str | None] = [None]  # --results-jsonl, set once the options are parsed


def pytest_configure(config):
    _RESULTS_JSONL[0] = config.getoption("--results-jsonl", default=None)
