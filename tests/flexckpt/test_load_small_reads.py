"""The load path over chunk columns (read_plan.file_plans and requests_of, PendingLoad.read),
end to end through real Checkpointers: paths the column tests do not reach on their own.
Loads in several threads at once (the structure's plan, part_of's and layout_from_json's
answers shared between them); requests and read groups cut small, read as a store's file
(one read a request) and as a local one (a read a group), over compressed and uncompressed
chunks, n-D box targets, bf16 and float8 targets, a non-contiguous target (the staging
copy), zero-element and 0-d tensors; and a damaged chunk that only a sink reads, named by
its request's range."""
from __future__ import annotations

import glob
import os
import threading

import pytest
import torch

from flexckpt import Checkpointer, ChecksumError
import flexckpt.load.pending as load_mod
from flexckpt.storage import RangeReader
from flexshard import BlockShard, HybridShard, Owned, Replicate, Shard, ShardedTensor
from flexshard.mesh_layout import MeshLayout


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "a": torch.randn(37, 19, generator=g),
        "b": torch.randn(101, generator=g).to(torch.bfloat16),
        "c": torch.randint(0, 120, (13, 7, 3), generator=g).to(torch.uint8).view(torch.float8_e4m3fn),
        "d": torch.randn(64, 8, generator=g).to(torch.float16),
        "e": torch.zeros(0, 5),
        "f": torch.tensor(3.5 + seed),
        "m": torch.randn(12, 10, generator=g),
    }


def _layout(name: str, world: int):
    if name == "m" and world == 4:
        return MeshLayout((2, 2), ("S0", "S1"))  # n-D boxes: one run a row
    return {"a": Shard(0), "b": BlockShard(7), "c": HybridShard(1), "d": Owned(world - 1), "e": Shard(0),
            "f": Replicate(), "m": BlockShard(5)}[name]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _load_and_check(url: str, want: dict, rank: int, world: int) -> None:
    target = {k: ShardedTensor.empty(tuple(v.shape), _layout(k, world), dtype=v.dtype, rank=rank, world_size=world)
              for k, v in want.items()}
    with Checkpointer(url, rank=rank, world_size=world, run_id="reader", read_only=True) as ck:
        ck.load(target)
    for k, v in want.items():
        expect = ShardedTensor.from_global(v, target[k].layout, rank, world).local
        assert torch.equal(_bits(target[k].local), _bits(expect)), (url, k, rank, world)


def test_checkpointers_loading_in_threads_at_once_each_get_their_own_checkpoints_bytes(tmp_path):
    # four checkpoints of one structure (so one shared write plan and shared cached layouts
    # and parts), different values, raw and zstd; four threads load them at once at worlds 1..4
    urls, states = [], []
    for i, codec in enumerate([None, "zstd", None, "zstd"]):
        urls.append(str(tmp_path / f"c{i}"))
        states.append(_state(i))
        with Checkpointer(urls[-1], compression=codec, chunk_bytes=256) as ck:
            ck.save(1, states[-1]).result()
    errors: list[BaseException] = []

    def loads(j: int) -> None:
        try:
            for world in (1, 2, 3, 4):
                for rank in range(world):
                    _load_and_check(urls[j], states[j], rank, world)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    threads = [threading.Thread(target=loads, args=(j,), daemon=True) for j in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a loading thread did not finish in 120 s"
    assert not errors, errors[0]


@pytest.fixture(params=["store", "local"])
def small_reads(monkeypatch, request):
    """Requests and read groups cut small; every file read as a store's (one read a
    request), or as a local file's (a read a group)."""
    if request.param == "store":
        monkeypatch.setattr(RangeReader, "local", property(lambda self: False))
    monkeypatch.setattr(load_mod, "FETCH_BYTES", 500)
    monkeypatch.setattr(load_mod, "READ_GROUP_BYTES", 200)


@pytest.mark.parametrize("codec", [None, "zstd"])
def test_a_resharding_load_in_small_requests_and_groups_is_exact(tmp_path, small_reads, codec):
    want = _state(7)
    url = str(tmp_path / "ck")
    with Checkpointer(url, compression=codec, chunk_bytes=256) as ck:
        ck.save(1, want).result()
    for world in (1, 3, 4):
        for rank in range(world):
            _load_and_check(url, want, rank, world)
    # plain targets: a non-contiguous one and a strided bf16 one go through the staging copy
    target = {**{k: torch.zeros_like(v) for k, v in want.items()},
              "a": torch.full((19, 37), -1.0).t(), "b": torch.zeros(202, dtype=torch.bfloat16)[::2]}
    with Checkpointer(url, read_only=True) as ck:
        ck.load(target)
        stats = ck.last_load_stats
    assert all(torch.equal(_bits(target[k]), _bits(v)) for k, v in want.items())
    assert stats.fetches > 1 and 0 < stats.bytes_read <= sum(os.path.getsize(p) for p in _data_files(url))


def _data_files(url: str) -> list[str]:
    return glob.glob(os.path.join(url, "**", "*.data"), recursive=True)


def test_a_damaged_byte_that_only_a_sink_reads_fails_the_load(tmp_path, small_reads):
    # rows 22..43 of 64 (rank 1 of 3), chunks of 4 KiB: the chunk holding row 21's last
    # bytes and row 22's first is read whole, row 21's part into the request's sink; a
    # damaged byte of row 21 must fail the load, named by the request's range and the chunk
    values = torch.arange(64 * 100, dtype=torch.float32).reshape(64, 100)
    url = str(tmp_path / "ck")
    with Checkpointer(url, chunk_bytes=4096) as ck:
        ck.save(1, {"w": values}).result()
    (path,) = _data_files(url)
    target = {"w": ShardedTensor.empty((64, 100), Shard(0), dtype=torch.float32, rank=1, world_size=3)}

    def damage(byte: int) -> None:
        raw = bytearray(open(path, "rb").read())
        raw[byte] ^= 0x01
        with open(path, "wb") as f:
            f.write(bytes(raw))

    damage(100)  # in the first chunk (bytes [0, 4096)), which rank 1 does not read
    with Checkpointer(url, rank=1, world_size=3, run_id="reader", read_only=True) as ck:
        ck.load(target)
    assert torch.equal(target["w"].local, values[22:44])
    damage(22 * 400 - 3)  # row 21, in the chunk [8192, 12288) that rows 22.. begin in: its sink part
    with Checkpointer(url, rank=1, world_size=3, run_id="reader", read_only=True) as ck:
        with pytest.raises(ChecksumError, match=r"r00000\.data bytes \[8192, \d+\): chunk at byte 8192 has checksum "
                                                r"[0-9a-f]{16}, the manifest says [0-9a-f]{16}; the file is damaged"):
            ck.load(target)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_box_and_flat_targets_of_random_shapes_load_exact_through_small_requests(tmp_path, small_reads, seed):
    # n-D boxes (a 2x2 mesh sharding two dims, either way round) and flat layouts, on random
    # shapes saved in chunks of 64 to 1024 bytes: runs cut at every chunk, segment and group bound
    import random

    rnd = random.Random(seed)
    shapes = {f"t{i}": tuple(rnd.randint(1, 23) for _ in range(rnd.randint(2, 3))) for i in range(4)}
    g = torch.Generator().manual_seed(seed)
    want = {k: (torch.randn(s, generator=g) * 100).to(rnd.choice([torch.float32, torch.bfloat16, torch.int8]))
            for k, s in shapes.items()}
    url = str(tmp_path / "ck")
    with Checkpointer(url, compression=rnd.choice([None, "zstd"]), chunk_bytes=rnd.choice([64, 256, 1024])) as ck:
        ck.save(1, want).result()
    layouts = [MeshLayout((2, 2), ("S0", "S1")), MeshLayout((2, 2), ("S1", "S0")), Shard(0), BlockShard(3),
               HybridShard(2)]
    for rank in range(4):
        target = {k: ShardedTensor.empty(v.shape, rnd.choice(layouts), dtype=v.dtype, rank=rank, world_size=4)
                  for k, v in want.items()}
        with Checkpointer(url, rank=rank, world_size=4, run_id="reader", read_only=True) as ck:
            ck.load(target)
        for k, v in want.items():
            expect = ShardedTensor.from_global(v, target[k].layout, rank, 4).local
            assert torch.equal(target[k].local, expect), (k, target[k].layout, rank)


def test_a_files_chunk_columns_are_read_only_so_no_load_changes_the_next(tmp_path):
    # issue 29: a file's raw chunk bounds are the plan's, shared by every load of the structure
    from flexckpt.catalog import read_manifest
    from flexckpt.storage import Storage

    url = str(tmp_path / "ck")
    with Checkpointer(url, chunk_bytes=256) as ck:
        ck.save(1, {"w": torch.arange(300.0)}).result(timeout=30)
    storage = Storage(url)
    (name,) = read_manifest(storage, 1).files
    entry = read_manifest(storage, 1).files[name]
    for column in (entry.raw_offsets, entry.raw_lengths):
        with pytest.raises(ValueError, match="read-only"):
            column[0] = 7
    again = read_manifest(storage, 1).files[name]
    assert again == entry and again.raw_offsets.tolist()[:2] == [0, 256] and len(again) == 6
