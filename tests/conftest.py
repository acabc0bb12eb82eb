"""Shared fixtures: a real S3-compatible server (moto's), started by the tests themselves."""
import os
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

# the helper modules the tests share (tests/helpers) import by name, here and in every
# spawned rank or subprocess (they inherit sys.path, or get it as PYTHONPATH)
sys.path.insert(0, str(Path(__file__).resolve().parent / "helpers"))


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


class SmallDisk:
    """A small filesystem for disk-full tests: a tmpfs of ``size`` bytes where the tests run as
    root and may mount one (``kind == "tmpfs"``), else a folder where flexckpt's ``Storage``
    writes fail with ENOSPC, after writing what still fits, once the folder holds ``size``
    bytes (``kind == "wrapper"``). ``fill(n)`` takes ``n`` bytes as another process would;
    ``free()`` gives them back."""

    def __init__(self, path, size: int, kind: str) -> None:
        self.path, self.size, self.kind = path, size, kind
        self._filler = path / "other-process.bin"

    def used(self) -> int:
        return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(self.path) for f in files)

    def fill(self, nbytes: int) -> None:
        self._filler.write_bytes(b"\0" * nbytes)

    def free(self) -> None:
        self._filler.unlink(missing_ok=True)


def _mount_tmpfs(path, size: int) -> bool:
    if os.geteuid() != 0 or os.environ.get("TEST_SMALL_DISK") == "wrapper":  # the knob tests the wrapper
        return False
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    return done.returncode == 0


def _enospc_wrapper(monkeypatch, disk: SmallDisk) -> None:
    import errno

    from flexckpt.storage import Storage

    real_stream, real_put = Storage.write_stream, Storage.put_atomic

    def full(path):
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    def room(self, rel):
        target = self.path(rel)
        here = os.path.getsize(target) if os.path.exists(target) else 0  # O_TRUNC gives it back
        return disk.size - disk.used() + here

    def write_stream(self, rel, parts, fsync=True):
        if not self.local or not self.path(rel).startswith(str(disk.path)):
            return real_stream(self, rel, parts, fsync)
        left = room(self, rel)

        def limited():
            nonlocal left
            for part in parts:
                view = memoryview(part)
                if view.nbytes > left:
                    yield view[:left]
                    raise full(self.path(rel))
                left -= view.nbytes
                yield part

        return real_stream(self, rel, limited(), fsync)

    def put_atomic(self, rel, data, fsync=True):
        if self.local and self.path(rel).startswith(str(disk.path)) and len(data) > room(self, rel):
            raise full(self.path(rel))
        return real_put(self, rel, data, fsync)

    monkeypatch.setattr(Storage, "write_stream", write_stream)
    monkeypatch.setattr(Storage, "put_atomic", put_atomic)
    monkeypatch.setattr(Storage, "write_direct", lambda self, *a, **k: False)  # as on tmpfs: no O_DIRECT


@pytest.fixture
def small_disk(tmp_path, monkeypatch):
    """``small_disk(size)`` -> a ``SmallDisk`` (see there); unmounted after the test."""
    mounted = []

    def make(size: int) -> SmallDisk:
        path = tmp_path / f"disk{len(mounted)}"
        path.mkdir()
        if _mount_tmpfs(path, size):
            mounted.append(path)
            return SmallDisk(path, size, "tmpfs")
        disk = SmallDisk(path, size, "wrapper")
        _enospc_wrapper(monkeypatch, disk)
        return disk

    yield make
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


class _ClosedPipe:
    """stdout whose reader has gone (``| head``): every write fails as a real pipe's does."""
    def __init__(self, fd: int) -> None:
        self.fd = fd

    def write(self, s: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    flush = write

    def fileno(self) -> int:
        return self.fd


@pytest.fixture
def closed_stdout(tmp_path, monkeypatch):
    """Call it to point ``sys.stdout`` at a pipe whose reader has gone (a CLI's output into ``| head``)."""
    with open(tmp_path / "closed-stdout", "w") as f:
        yield lambda: monkeypatch.setattr(sys, "stdout", _ClosedPipe(f.fileno()))
