"""The same checkpointer against a real S3-compatible server process (moto)."""
import pytest
import s3fs
import torch

from flexckpt import Checkpointer, ChecksumError
from flexckpt.commit import read_manifest
from flexckpt.manifest import MANIFEST, data_name, step_dir
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
