"""The same checkpointer against a real S3-compatible server process (moto)."""
import pytest
import s3fs
import torch

from flexckpt import Checkpointer, ChecksumError
from flexckpt.catalog import read_manifest
from flexckpt.format.names import MANIFEST, data_name, step_dir
from flexckpt.storage import Storage
from flexshard import BlockShard, Shard, ShardedTensor


def test_s3_round_trip_with_resharding_retention_and_one_put_per_commit(s3_options, monkeypatch):
    opts, bucket = s3_options
    url = f"s3://{bucket}/run1"
    puts = []
    real_put = Storage.put_atomic
    monkeypatch.setattr(Storage, "put_atomic", lambda self, rel, data, fsync=True: (puts.append(rel), real_put(self, rel, data, fsync)))
    full = torch.randn(300, 7)
    # rank 1 uses its own filesystem object: the coordinator must see its record through a fresh listing
    r0 = Checkpointer(url, rank=0, world_size=2, run_id="s3job", keep_last=2, storage_options=opts, chunk_bytes=1024, compression="zstd")
    r1 = Checkpointer(url, rank=1, world_size=2, run_id="s3job", keep_last=2, chunk_bytes=1024, compression="zstd",
                      storage_options={**opts, "skip_instance_cache": True})
    for step in (1, 2, 3):
        hs = [ck.save(step, {"w": ShardedTensor.from_global(full + step, Shard(0), r, 2), "step": step}) for r, ck in enumerate((r0, r1))]
        assert [h.result(timeout=60) for h in hs] == [step, step]
    r0.close(), r1.close()
    assert puts.count(f"{step_dir(3)}/{MANIFEST}") == 1
    fs = s3fs.S3FileSystem(**opts, skip_instance_cache=True)
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{bucket}/run1")) == [step_dir(2), step_dir(3)]
    for r in range(3):
        with Checkpointer(url, rank=r, world_size=3, run_id="reader", storage_options=opts) as ck:
            target = {"w": ShardedTensor.empty((300, 7), BlockShard(32), rank=r, world_size=3), "step": 0}
            assert ck.load(target) == 3 and target["step"] == 3
            assert torch.equal(target["w"].local, ShardedTensor.from_global(full + 3, BlockShard(32), r, 3).local)


def test_s3_damaged_object_fails_the_load(s3_options):
    opts, bucket = s3_options
    url = f"s3://{bucket}/run2"
    with Checkpointer(url, storage_options=opts, chunk_bytes=256) as ck:
        ck.save(1, {"w": torch.arange(200.0)}).result(timeout=60)
        fs = s3fs.S3FileSystem(**opts, skip_instance_cache=True)
        key = f"{bucket}/run2/{step_dir(1)}/{data_name(read_manifest(ck.storage, 1).attempt, 0)}"
        data = bytearray(fs.cat_file(key))
        data[300] ^= 0xFF
        fs.pipe_file(key, bytes(data))
        with pytest.raises(ChecksumError):
            ck.load({"w": torch.zeros(200)})


# -- a store that cannot work (issue 25 items 7-9) --------------------------------------------------
@pytest.fixture
def no_aws_env(monkeypatch, tmp_path):
    """No credentials anywhere botocore looks (variables, files, instance metadata)."""
    import os

    for k in list(os.environ):
        if k.startswith("AWS_") or k == "FLEXCKPT_STORAGE_OPTIONS":
            monkeypatch.delenv(k)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))


def _unusable(s3_endpoint, bucket):
    """(what is wrong, url, storage options, a word the error must say)."""
    ok = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": s3_endpoint}}
    return [
        ("no credentials", f"s3://{bucket}/run", {"client_kwargs": {"endpoint_url": s3_endpoint}},
         "no credentials: set AWS_ACCESS_KEY_ID"),
        ("no bucket", f"s3://{bucket}-missing/run", ok, "does not exist"),
        ("no bucket (the URL is one)", f"s3://{bucket}-missing", ok, "does not exist"),
        ("no endpoint", f"s3://{bucket}/run", {**ok, "client_kwargs": {"endpoint_url": "http://127.0.0.1:9"},
                                             "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2}},
         "the endpoint does not answer"),
    ]


def test_a_store_that_cannot_work_fails_at_construction_in_one_line(s3_options, s3_endpoint, no_aws_env, caplog):
    import logging

    from flexckpt import StorageError

    _, bucket = s3_options
    for i, (what, url, opts, cause) in enumerate(_unusable(s3_endpoint, bucket)):
        for read_only in (False, True) if i == 0 else (False,):  # a reader (the CLI's exports) too
            with caplog.at_level(logging.INFO, logger="flexckpt"), pytest.raises(StorageError) as e:
                Checkpointer(url, storage_options=opts, read_only=read_only)
            msg = str(e.value)
            assert msg.startswith(url + ": ") and cause in msg and "\n" not in msg, (what, msg)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_every_call_of_a_rank_that_did_not_probe_raises_the_librarys_errors(s3_options, s3_endpoint, no_aws_env):
    from flexckpt import CheckpointError

    _, bucket = s3_options
    _, url, opts, cause = _unusable(s3_endpoint, bucket)[0]
    ck = Checkpointer(url, storage_options=opts, rank=1, world_size=2, run_id="noprobe")  # rank 0 probes, not rank 1
    try:
        for call in (ck.steps, ck.contents, lambda: ck.load({"w": torch.zeros(2)})):
            with pytest.raises(CheckpointError, match=cause):
                call()
        # (a save's result() raised SaveError already; it now names the cause too: 4 s more to show it)
    finally:
        ck.close()


def test_the_cli_takes_storage_options_or_the_aws_variables(s3_options, s3_endpoint, no_aws_env, monkeypatch, capsys):
    import json

    from flexckpt.cli import main

    opts, bucket = s3_options
    url = f"s3://{bucket}/cli"
    with Checkpointer(url, storage_options=opts) as ck:
        ck.save(4, {"w": torch.ones(3)}).result(timeout=60)
    capsys.readouterr()
    assert main(["steps", url]) == 2  # nothing says where the endpoint is, nor the credentials
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and url in err and "no credentials" in err, err
    given = json.dumps(opts)
    assert main(["steps", url, "--storage-options", given]) == 0 and "4" in capsys.readouterr().out
    assert main(["steps", f"s3://{bucket}-missing/cli", "--storage-options", given]) == 2
    assert f"the bucket '{bucket}-missing' does not exist" in capsys.readouterr().err  # not "no checkpoint"
    assert main(["inspect", url, "--storage-options", "[1]"]) == 2
    assert "--storage-options must be a JSON object" in capsys.readouterr().err
    monkeypatch.setenv("FLEXCKPT_STORAGE_OPTIONS", given)
    assert main(["verify", url]) == 0
    monkeypatch.delenv("FLEXCKPT_STORAGE_OPTIONS")
    for k, v in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"), ("AWS_ENDPOINT_URL", s3_endpoint)):
        monkeypatch.setenv(k, v)
    capsys.readouterr()
    assert main(["steps", url, "--storage-options", '{"skip_instance_cache": true}']) == 0
    assert "4" in capsys.readouterr().out
