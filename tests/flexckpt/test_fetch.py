"""The load's read-and-verify loop on a local file: a fetch's chunks are read in groups of
about ``READ_GROUP_BYTES`` and each group verified before the next is read; the reading
threads' shares run under one stall watch each (``storage_stall.bounded_all``)."""
import os
import threading
import time

import pytest
import torch

from flexckpt import Checkpointer, ChecksumError
from flexckpt.format.names import step_dir
import flexckpt.load.pending as load_mod
from flexckpt.storage import RangeReader
from flexckpt.storage_stall import StorageStalled, bounded_all, progress
from flexshard import Shard, ShardedTensor


def data_path(root, step):
    folder = os.path.join(root, step_dir(step))
    (sub,) = [d for d in os.listdir(folder) if os.path.isdir(os.path.join(folder, d))]
    (name,) = [n for n in os.listdir(os.path.join(folder, sub)) if n.endswith(".data")]
    return os.path.join(folder, sub, name)


def counting_reads(monkeypatch):
    calls = []
    real = RangeReader.read_scatter

    def read_scatter(self, offset, outs):
        calls.append((offset, sum(o.nbytes for o in outs)))
        return real(self, offset, outs)

    monkeypatch.setattr(RangeReader, "read_scatter", read_scatter)
    return calls


def test_a_fetch_is_read_in_groups_of_chunks_each_verified_and_the_values_exact(tmp_path, monkeypatch):
    values = torch.arange(512 * 1024, dtype=torch.float32)  # 2 MiB: 16 chunks of 128 KiB
    with Checkpointer(str(tmp_path)) as ckpt:
        ckpt.save(1, {"w": values}).result()
        calls = counting_reads(monkeypatch)
        target = {"w": torch.zeros_like(values)}
        ckpt.load(target)
        assert torch.equal(target["w"], values)
        assert calls == [(i * (512 << 10), 512 << 10) for i in range(4)]  # 4 groups of 4 chunks, in order
        calls.clear()
        monkeypatch.setattr(load_mod, "READ_GROUP_BYTES", 300 << 10)  # a group closes once it reaches the size
        target["w"].zero_()
        ckpt.load(target)
        assert torch.equal(target["w"], values)
        assert calls == [(0, 384 << 10), (384 << 10, 384 << 10), (768 << 10, 384 << 10), (1152 << 10, 384 << 10),
                         (1536 << 10, 384 << 10), (1920 << 10, 128 << 10)]


@pytest.mark.parametrize("byte", [100, (2 << 20) - 1])  # in the first group, in the last one
def test_a_damaged_chunk_in_any_group_is_named_by_its_offset(tmp_path, byte):
    values = torch.arange(512 * 1024, dtype=torch.float32)
    with Checkpointer(str(tmp_path)) as ckpt:
        ckpt.save(1, {"w": values}).result()
        path = data_path(str(tmp_path), 1)
        raw = bytearray(open(path, "rb").read())
        raw[byte] ^= 0x01
        with open(path, "wb") as f:
            f.write(bytes(raw))
        chunk = byte // (128 << 10) * (128 << 10)
        with pytest.raises(ChecksumError, match=rf"chunk at byte {chunk} has checksum [0-9a-f]{{16}}, the manifest says"):
            ckpt.load({"w": torch.zeros_like(values)})


def test_compressed_chunks_cut_by_the_target_load_exact_and_a_damaged_one_is_named_by_its_range(tmp_path):
    # zstd chunks of 4 KiB saved at world 1; rank 1 of 3 wants rows 22..43 (Shard(0)): the
    # first and last chunks it touches are cut, each chunk decompressed once and copied in
    values = torch.arange(64 * 100, dtype=torch.float32).reshape(64, 100)
    with Checkpointer(str(tmp_path), compression="zstd", chunk_bytes=4096) as ckpt:
        ckpt.save(1, {"w": values}).result()
    target = {"w": ShardedTensor.empty((64, 100), Shard(0), dtype=torch.float32, rank=1, world_size=3)}
    with Checkpointer(str(tmp_path), rank=1, world_size=3, run_id="rd") as ck:
        ck.load(target)
        assert torch.equal(target["w"].local, ShardedTensor.from_global(values, Shard(0), 1, 3).local)
        assert ck.last_load_stats.direct_chunks == 0
    path = data_path(str(tmp_path), 1)
    raw = bytearray(open(path, "rb").read())
    raw[-5] ^= 0x01  # in the last chunk
    with open(path, "wb") as f:
        f.write(bytes(raw))
    with Checkpointer(str(tmp_path)) as ck:
        with pytest.raises(ChecksumError, match=rf"r00000.data bytes \[0, {len(raw)}\): checksum [0-9a-f]{{16}} does "
                                                rf"not match the manifest's [0-9a-f]{{16}}; the file is damaged"):
            ck.load({"w": torch.zeros_like(values)})


def test_bounded_all_returns_results_in_order_and_raises_the_first_error_after_all_ended():
    ended = []

    def slow(v):
        def fn():
            for _ in range(5):
                time.sleep(0.02)
                progress()
            ended.append(v)
            return v
        return fn

    assert bounded_all(0.5, "x", [slow(1), slow(2), lambda: 3]) == [1, 2, 3]

    def bad():
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        bounded_all(0.5, "x", [bad, slow(4)])
    assert 4 in ended  # the other call ran to its end before the error was raised


def test_a_stalled_share_is_given_up_within_the_timeout_while_a_moving_one_is_not():
    release = threading.Event()

    def moving():
        for _ in range(30):
            time.sleep(0.02)
            progress()
        return "done"

    t0 = time.monotonic()
    with pytest.raises(StorageStalled, match=r"storage call reading 7 ranges made no progress for 0.3 s"):
        bounded_all(0.3, "reading 7 ranges", [moving, lambda: release.wait(10)])
    assert 0.3 <= time.monotonic() - t0 < 0.55  # given up before the moving share (0.6 s) ends
    release.set()


def test_a_stores_file_is_read_a_fetch_per_request_also_when_the_fast_tiers_view_routes_it(tmp_path, monkeypatch):
    """Grouping is decided per file: a store's file (here ``memory://``) is read one request a
    fetch, also through the fast tier's view over a local folder, which routes a part missing
    from every node to the store; the node's own files and a peer's ranges are read in groups."""
    import uuid

    from flexckpt.storage import Storage
    from flexckpt.tier.view import Received, StepView

    values = torch.arange(512 * 1024, dtype=torch.float32)  # 2 MiB: one fetch, 16 chunks
    with Checkpointer(f"memory://loadloop-{uuid.uuid4().hex}") as ckpt:
        ckpt.save(1, {"w": values}).result()
        calls = counting_reads(monkeypatch)
        target = {"w": torch.zeros_like(values)}
        ckpt.load(target)
        assert torch.equal(target["w"], values)
        assert calls == [(0, 2 << 20)]  # the whole fetch in one request
        store = ckpt.storage
        (saved,) = [p for p in store.fs.find(store.root) if p.endswith(".data")]
        saved = os.path.relpath(saved, store.root)
    node = Storage(str(tmp_path))
    (tmp_path / "own.data").write_bytes(b"x" * 8)
    view = StepView(node, {saved: store, "peer.data": Received("peer.data", 8, "a peer")})
    assert view.local  # the view is over the node's folder ...
    assert not view.open_reader(saved).local  # ... but the store's file through it is read a fetch per request
    assert view.open_reader("own.data").local and view.open_reader("peer.data").local


def test_a_reading_thread_held_up_by_one_request_leaves_the_others_to_the_other_thread(tmp_path, monkeypatch):
    """The reading threads take the next request once done with one (no fixed split): while
    one thread waits on the first request, the other reads all the rest."""
    values = torch.arange(512 * 1024, dtype=torch.float32)  # 2 MiB: 16 chunks of 128 KiB
    monkeypatch.setattr(load_mod, "FETCH_BYTES", 128 << 10)  # a request a chunk: 16
    real = RangeReader.read_scatter
    by_thread = {}

    def read_scatter(self, offset, outs):
        if offset == 0:
            time.sleep(0.5)
        by_thread.setdefault(threading.get_ident(), []).append(offset)
        return real(self, offset, outs)

    with Checkpointer(str(tmp_path), read_threads=2) as ckpt:
        ckpt.save(1, {"w": values}).result()
        monkeypatch.setattr(RangeReader, "read_scatter", read_scatter)
        target = {"w": torch.zeros_like(values)}
        ckpt.load(target)
        assert torch.equal(target["w"], values)
        assert ckpt.last_load_stats.fetches == 16
    assert sorted(map(len, by_thread.values())) == [1, 15]
    slow, fast = sorted(by_thread.values(), key=len)
    assert slow == [0] and fast == [k * (128 << 10) for k in range(1, 16)]  # the rest, in file order


def test_a_scattered_read_fills_every_buffer_over_short_reads_and_more_buffers_than_one_preadv_takes(
        tmp_path, monkeypatch):
    """``RangeReader.read_scatter``: one preadv where it can, the rest read on from where a
    short read stopped (here at most 1000 bytes a call), more than IOV_MAX buffers in
    several calls, empty buffers skipped; returns the bytes read; past the end: TruncatedFile."""
    import flexckpt.storage as storage_mod
    from flexckpt.errors import TruncatedFile
    from flexckpt.storage import IOV_MAX, Storage

    data = bytes(range(256)) * 64  # 16 KiB
    (tmp_path / "f.data").write_bytes(data)
    sizes = [i % 7 for i in range(IOV_MAX + 500)]  # 1524 buffers, one in seven empty: 4569 bytes
    with Storage(str(tmp_path)).open_reader("f.data") as rd:
        for cap in (None, 1000):
            if cap is not None:
                real = os.preadv
                monkeypatch.setattr(storage_mod.os, "preadv", lambda fd, bufs, pos: real(fd, trim(bufs, cap), pos))
            buf = bytearray(sum(sizes))
            views, at = [], 0
            for n in sizes:
                views.append(memoryview(buf)[at : at + n])
                at += n
            assert rd.read_scatter(100, views) == len(buf)
            assert bytes(buf) == data[100 : 100 + len(buf)]
        with pytest.raises(TruncatedFile, match=rf"ends at byte {len(data)}, expected {len(data) + 10}"):
            rd.read_scatter(len(data) - 2000, [memoryview(bytearray(1990)), memoryview(bytearray(20))])


def trim(bufs, cap):
    """The first ``cap`` bytes of the buffers ``bufs``: what a short read fills."""
    out = []
    for b in bufs:
        if cap <= 0:
            break
        out.append(b[:cap])
        cap -= min(cap, b.nbytes)
    return out


def test_a_stall_timeout_of_infinity_waits_for_ever(tmp_path):
    """stall_timeout=float('inf') (the Storage takes any positive number) waits without a
    bound; it used to fail every storage call (a wait longer than the platform's longest)."""
    from flexckpt.storage import Storage
    from flexckpt.storage_stall import bounded

    (tmp_path / "x").write_bytes(b"abc")
    assert Storage(str(tmp_path), stall_timeout=float("inf")).read_bytes("x") == b"abc"
    assert bounded(float("inf"), "x", lambda: 1) == 1
    assert bounded_all(1e12, "x", [lambda: 1, lambda: 2]) == [1, 2]
    values = torch.arange(1000, dtype=torch.float32)
    with Checkpointer(str(tmp_path / "ck"), stall_timeout=float("inf")) as ck:
        ck.save(1, {"w": values}).result()
        target = {"w": torch.zeros_like(values)}
        ck.load(target)
        assert torch.equal(target["w"], values)


def test_calls_run_together_without_a_timeout_leave_each_storage_call_its_own_watch():
    """A fast tier's recovery view has no timeout of its own (``stall_timeout`` None), so the
    load's reads run under ``bounded_all(None, ...)``; a read it routes to the store must
    still be given up after the store's timeout (before: it ran unwatched, for ever)."""
    from flexckpt.storage_stall import StorageStalled, bounded, bounded_all

    t0 = time.monotonic()
    with pytest.raises(StorageStalled, match="slow read"):
        bounded_all(None, "the load's reads", [lambda: bounded(0.2, "slow read", lambda: time.sleep(1.5))])
    assert time.monotonic() - t0 < 1.2


def test_a_load_reads_a_local_file_with_one_thread_when_its_node_has_fewer_than_two_cores_a_rank(tmp_path, monkeypatch):
    from flexckpt import Checkpointer
    from flexckpt.load.fetch import read_threads_for

    assert read_threads_for(True, cpus=2, local_ranks=2) == 1  # this machine with 2 ranks: copying and hashing
    assert read_threads_for(True, cpus=2, local_ranks=1) == 2
    assert read_threads_for(True, cpus=96, local_ranks=8) == 2
    assert read_threads_for(False, cpus=2, local_ranks=4) == 2  # a store's reads wait on the network
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "not a number")
    assert read_threads_for(True, cpus=4) == 2  # unset or unreadable: one rank
    cpus = len(os.sched_getaffinity(0))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cpus))
    with Checkpointer(str(tmp_path / "a"), read_only=True) as ck:
        assert ck.read_threads == 1
    with Checkpointer(str(tmp_path / "b"), read_only=True, read_threads=3) as ck:
        assert ck.read_threads == 3  # given: kept
    with Checkpointer("memory://rt-test", read_only=True) as ck:
        assert ck.read_threads == 2  # not a local filesystem: 2, whatever the cores
