"""Shared fixtures: a real S3-compatible server (moto's), started by the tests themselves."""
import os
import socket
import subprocess
import sys
import time
import urllib.request
import uuid

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_endpoint():
    """An S3 server in its own process on a free port; stopped after the session."""
    port = _free_port()
    env = dict(os.environ, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(url + "/moto-api/", timeout=1)
            break
        except Exception:  # noqa: BLE001 - not up yet
            if proc.poll() is not None:
                raise RuntimeError(f"moto server exited: {proc.stderr.read().decode()[-2000:]}")
            if time.monotonic() > deadline:
                proc.kill()
                raise TimeoutError("moto server did not start within 60 s")
            time.sleep(0.2)
    try:
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture
def s3_options(s3_endpoint):
    """fsspec storage options for the test server, with a fresh bucket; returns (options, bucket)."""
    import s3fs

    opts = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": s3_endpoint}}
    bucket = f"test-{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem(**opts).mkdir(bucket)
    return opts, bucket
