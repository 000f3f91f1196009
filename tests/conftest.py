from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


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
