"""Where a load's bytes come from (``LoadStats.bytes_from_store``, ``bytes_from_peers``):
exact counts on small checkpoints, computed from the manifest (the chunks a target's
pieces touch, the chunk table, the bytes values), not from the load's own plan."""
from __future__ import annotations

import torch

from flexckpt import Checkpointer
from flexckpt.catalog import read_manifest
from flexckpt.storage import Storage
from flexshard import Replicate, Shard, ShardedTensor


def _state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.randn(100, generator=g), "blob": b"x" * 1000}


def _touched_bytes(m, wanted: list[tuple[str, int, int]]) -> int:
    """Stored bytes of the chunks holding elements ``[lo, hi)`` of flat float32 tensors
    (``(name, lo, hi)`` each; a chunk counted once): from the manifest's pieces and the
    files' chunk entries."""
    touched: set[tuple[str, int]] = set()
    for name, lo, hi, piece in [(n, lo, hi, p) for n, lo, hi in wanted for p in m.tensors[n].all_pieces()]:
        a, b = max(lo, piece.start), min(hi, piece.stop)
        if a >= b:
            continue
        first, last = piece.raw_offset + (a - piece.start) * 4, piece.raw_offset + (b - piece.start) * 4
        e = m.files[piece.file]
        for k in range(len(e)):
            if e.raw_offsets[k] < last and e.raw_offsets[k] + e.raw_lengths[k] > first:
                touched.add((piece.file, k))
    return sum(int(m.files[f].lengths[k]) for f, k in touched)


def test_a_load_at_the_saved_world_counts_the_data_file_its_table_and_the_bytes_values_read_from_the_store(tmp_path):
    url = str(tmp_path / "ck")
    with Checkpointer(url, chunk_bytes=1024) as ck:
        ck.save(1, _state()).result()
    m = read_manifest(Storage(url), 1)
    target = {"w": torch.zeros(64, 32), "b": torch.zeros(100), "blob": b""}
    with Checkpointer(url, run_id="reader", read_only=True) as ck:
        ck.load(target)
        stats = ck.last_load_stats
    assert target["blob"] == b"x" * 1000 and torch.equal(target["w"], _state()["w"])
    e = m.ranks[0]
    assert stats.bytes_from_store == e.stored_nbytes + e.table_nbytes + 1000
    assert stats.bytes_from_peers == 0
    assert stats.bytes_from_store == stats.bytes_read + stats.metadata_bytes


def test_a_resharding_load_counts_only_the_chunks_its_part_touches_and_the_tables_of_their_files(tmp_path):
    url = str(tmp_path / "ck")
    with Checkpointer(url, chunk_bytes=1024) as ck:
        ck.save(1, {k: v for k, v in _state().items() if k != "blob"}).result()
    m = read_manifest(Storage(url), 1)
    world, rank = 4, 2
    target = {"w": ShardedTensor.empty((64, 32), Shard(0), rank=rank, world_size=world),
              "b": ShardedTensor.empty((100,), Replicate(), rank=rank, world_size=world)}
    with Checkpointer(url, rank=rank, world_size=world, run_id="reader", read_only=True) as ck:
        ck.load(target)
        stats = ck.last_load_stats
    assert torch.equal(target["w"].local, _state()["w"][32:48])
    want = _touched_bytes(m, [("w", 32 * 32, 48 * 32), ("b", 0, 100)])
    assert want < m.ranks[0].stored_nbytes  # a part of the file, not all of it
    assert stats.bytes_from_store == want + m.ranks[0].table_nbytes
    assert stats.bytes_from_peers == 0


def test_a_load_says_where_its_time_went_plan_fetch_agree_apply(tmp_path, monkeypatch):
    """``LoadStats``' seconds: a slow manifest read shows in ``plan_s``, slow data reads in
    ``fetch_s``, each only there; the phases add up to no more than the load's wall time."""
    import time

    import flexckpt.load.committed as committed
    import flexckpt.load.fetch as fetch

    url = str(tmp_path / "ck")
    with Checkpointer(url, chunk_bytes=1024) as ck:
        ck.save(1, _state()).result()
    read_manifest_, read_scatter = committed.read_manifest, fetch.StoreSource.read_scatter

    def slow_manifest(*a, **k):
        time.sleep(0.2)
        return read_manifest_(*a, **k)

    def slow_read(self, *a, **k):
        time.sleep(0.1)
        return read_scatter(self, *a, **k)

    target = {"w": torch.zeros(64, 32), "b": torch.zeros(100), "blob": b""}
    with Checkpointer(url, run_id="reader", read_only=True) as ck:
        monkeypatch.setattr(committed, "read_manifest", slow_manifest)
        t0 = time.perf_counter()
        ck.load(target)
        wall = time.perf_counter() - t0
        s = ck.last_load_stats
        assert s.plan_s >= 0.2 and s.fetch_s < 0.2, (s.plan_s, s.fetch_s)
        monkeypatch.setattr(committed, "read_manifest", read_manifest_)
        monkeypatch.setattr(fetch.StoreSource, "read_scatter", slow_read)
        ck.load(target)
        s2 = ck.last_load_stats
        assert s2.fetch_s >= 0.1 * s2.fetches and s2.plan_s < 0.1, (s2.fetch_s, s2.plan_s, s2.fetches)
    assert s.agree_s >= 0 and s.apply_s >= 0
    assert s.plan_s + s.fetch_s + s.agree_s + s.apply_s <= wall
    assert torch.equal(target["w"], _state()["w"])
