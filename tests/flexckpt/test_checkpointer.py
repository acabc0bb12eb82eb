"""The checkpointer in one process: round trips, commit order, retention, failures,
corruption, strictness. Several ranks of one job are played by several Checkpointers with
explicit rank/world (saves need no process group: that is the point)."""
import logging
import os
import pickle
import threading
import time

import pytest
import torch

from flexckpt import (
    ByLane,
    Checkpointer,
    ChecksumError,
    LoadError,
    PerRank,
    SaveError,
    StructureMismatch,
)
from flexckpt.format.names import MANIFEST, step_dir
from flexckpt.storage import Storage
from flexshard import BlockShard, Owned, Replicate, Shard, ShardedTensor


def data_path(root, step, rank):
    """Rank ``rank``'s data file of the committed attempt of ``step``."""
    import orjson

    attempt = orjson.loads((root / step_dir(step) / MANIFEST).read_bytes())["attempt"]
    return root / step_dir(step) / attempt / f"r{rank:05d}.data"


class Counter:
    """A stateful object, like a scheduler."""

    def __init__(self, n=0):
        self.n = n
        self.loaded_with = None

    def state_dict(self):
        return {"n": self.n, "history": torch.full((5,), self.n, dtype=torch.int64)}

    def load_state_dict(self, sd):
        self.loaded_with = sd
        self.n = sd["n"]


def full_state(seed=0):
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(4, 6, generator=g)).sum().backward()
    opt.step()
    return {
        "model": model,
        "optim": opt,
        "sched": Counter(5),
        "tensors": {
            "bf16": torch.randn(17, 4, generator=g).to(torch.bfloat16),
            "bool": torch.rand(9, generator=g) > 0.5,
            "int": torch.randint(-(2**40), 2**40, (10,), generator=g),
            "scalar": torch.tensor(3.5),
            "empty": torch.zeros(0, 4),
            "f64": torch.randn(3, 3, dtype=torch.float64, generator=g),
        },
        "sharded": ShardedTensor.from_global(torch.randn(10, 3, generator=g), Shard(0)),
        "step": 42,
        "loss": float("inf"),
        "nan": float("nan"),
        "name": "run-α",
        "flags": [True, None, 1.5],
        "betas": (0.9, 0.95),
        "lanes": ByLane({"0": {"doc": 3, "epoch": 1}, "1": {"doc": 7, "epoch": 0}}),
        "rng": PerRank(torch.get_rng_state()),
    }


def empty_like_state():
    s = full_state(seed=1)
    for t in s["tensors"].values():
        t.zero_()
    s["sharded"].local.zero_()
    s.update(step=0, loss=0.0, nan=0.0, name="", flags=[False, 0, 0.0], betas=(0.0, 0.0), lanes=ByLane(), rng=PerRank(None))
    s["sched"] = Counter(0)
    return s


def assert_state_equal(a, b):
    for k, v in a["tensors"].items():
        assert v.dtype == b["tensors"][k].dtype and torch.equal(v, b["tensors"][k]), k
    for (ka, va), (kb, vb) in zip(a["model"].state_dict().items(), b["model"].state_dict().items()):
        assert ka == kb and torch.equal(va, vb)
    sa, sb = a["optim"].state_dict(), b["optim"].state_dict()
    for pid in sa["state"]:
        for k in sa["state"][pid]:
            assert torch.equal(sa["state"][pid][k], sb["state"][pid][k])
    assert sa["param_groups"] == sb["param_groups"]
    assert torch.equal(a["sharded"].local, b["sharded"].local)
    assert (b["step"], b["loss"], b["name"], b["flags"], b["betas"]) == (42, float("inf"), "run-α", [True, None, 1.5], (0.9, 0.95))
    assert b["nan"] != b["nan"]
    assert b["sched"].n == 5 and torch.equal(b["sched"].loaded_with["history"], torch.full((5,), 5))
    assert b["lanes"].values == {"0": {"doc": 3, "epoch": 1}, "1": {"doc": 7, "epoch": 0}}
    assert b["rng"].restored and torch.equal(b["rng"].value, a["rng"].value)


@pytest.fixture(params=["file", "memory"])
def url(request, tmp_path):
    if request.param == "file":
        return f"file://{tmp_path}/ckpt"
    return f"memory://flexckpt-test-{os.getpid()}-{time.monotonic_ns()}"


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_every_kind_of_value_round_trips_bit_exactly(url, compression):
    state = full_state()
    with Checkpointer(url, compression=compression, chunk_bytes=256) as ckpt:
        h = ckpt.save(7, state)
        h.wait_staged()
        assert h.result() == 7
        target = empty_like_state()
        assert ckpt.load(target) == 7
    assert_state_equal(state, target)


def test_zstd_shrinks_compressible_state_and_still_verifies(tmp_path):
    state = {"zeros": torch.zeros(1 << 18), "ramp": torch.arange(1 << 16, dtype=torch.int32)}
    sizes = {}
    for comp in (None, "zstd:3"):
        with Checkpointer(str(tmp_path / str(comp)), compression=comp) as ckpt:
            ckpt.save(1, state).result()
            sizes[comp] = os.path.getsize(data_path(tmp_path / str(comp), 1, 0))
            target = {"zeros": torch.ones(1 << 18), "ramp": torch.zeros(1 << 16, dtype=torch.int32)}
            ckpt.load(target)
            assert torch.equal(target["zeros"], state["zeros"]) and torch.equal(target["ramp"], state["ramp"])
    assert sizes[None] == (1 << 20) + (1 << 18)
    assert sizes["zstd:3"] < sizes[None] / 5


def test_after_the_fence_the_state_may_change_without_touching_the_checkpoint(tmp_path):
    w = torch.arange(1 << 20, dtype=torch.float32)
    with Checkpointer(str(tmp_path)) as ckpt:
        h = ckpt.save(1, {"w": w})
        h.wait_staged()
        w.add_(1)  # the optimizer step
        h.result()
        target = {"w": torch.zeros_like(w)}
        ckpt.load(target)
    assert torch.equal(target["w"], torch.arange(1 << 20, dtype=torch.float32))


def test_the_fence_cuts_the_staging_pause_short(tmp_path):
    with Checkpointer(str(tmp_path), stage_delay=1.0) as ckpt:
        h = ckpt.save(1, {"w": torch.ones(1 << 16)})
        time.sleep(0.05)
        assert not h.staged()  # still pausing: the copy has not taken a core yet
        t0 = time.monotonic()
        h.wait_staged()
        assert time.monotonic() - t0 < 0.5
        assert h.result(timeout=10) == 1


def test_large_tensors_are_read_straight_into_the_target(tmp_path):
    w = torch.randn(1 << 20)
    with Checkpointer(str(tmp_path), chunk_bytes=1 << 20) as ckpt:
        ckpt.save(1, {"w": w}).result()
        target = {"w": torch.zeros_like(w)}
        ckpt.load(target)
        stats = ckpt.last_load_stats
    assert torch.equal(target["w"], w)
    assert stats.chunks == 16 and stats.bytes_read == 4 << 20  # 1/16 of the piece per chunk
    assert stats.direct_chunks == 16  # every byte read straight into the target
    assert stats.fetches == 1  # adjacent chunks: one ranged read


def test_direct_and_page_cache_writes_give_identical_files(tmp_path, monkeypatch):
    state = {"a": torch.randn(1000, 7), "b": torch.arange(13, dtype=torch.int16)}  # sizes off any 4 KiB boundary
    used = []
    real = Storage.write_direct
    monkeypatch.setattr(Storage, "write_direct", lambda self, *a, **k: used.append(real(self, *a, **k)) or used[-1])
    files = {}
    for direct in (True, False):
        with Checkpointer(str(tmp_path / str(direct)), direct_io=direct, run_id="same") as ckpt:
            ckpt.save(1, state).result()
            files[direct] = data_path(tmp_path / str(direct), 1, 0).read_bytes()
            target = {"a": torch.zeros(1000, 7), "b": torch.zeros(13, dtype=torch.int16)}
            ckpt.load(target)
            assert torch.equal(target["a"], state["a"]) and torch.equal(target["b"], state["b"])
    # a: 28000 bytes at 0; b: 26 bytes at 28032 (64-byte aligned); the stream ends padded to 28096
    assert files[True] == files[False] and len(files[True]) == 28096
    assert used and (used == [True] or used == [False])  # False only where the filesystem refuses O_DIRECT


def test_manifest_is_written_last_and_atomically(tmp_path, monkeypatch):
    events = []
    real_stream, real_put = Storage.write_stream, Storage.put_atomic

    def write_stream(self, rel, parts, fsync=True):
        events.append(("data", rel))
        return real_stream(self, rel, parts, fsync)

    def put_atomic(self, rel, data, fsync=True):
        events.append(("put", rel))
        assert not os.path.exists(self.path(rel))  # an attempt never overwrites a file
        return real_put(self, rel, data, fsync)

    real_direct = Storage.write_direct

    def write_direct(self, rel, data, nbytes, fsync=True):
        events.append(("data", rel))
        return real_direct(self, rel, data, nbytes, fsync)

    monkeypatch.setattr(Storage, "write_stream", write_stream)
    monkeypatch.setattr(Storage, "write_direct", write_direct)
    monkeypatch.setattr(Storage, "put_atomic", put_atomic)
    fsyncs = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (fsyncs.append(fd), real_fsync(fd)))
    replaces = []
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (replaces.append((a, b)), real_replace(a, b)))
    r0 = Checkpointer(str(tmp_path), rank=0, world_size=2, run_id="job")
    r1 = Checkpointer(str(tmp_path), rank=1, world_size=2, run_id="job")
    state = lambda r: {"w": ShardedTensor.from_global(torch.arange(8.0), Shard(0), r, 2)}  # noqa: E731
    h0 = r0.save(3, state(0))
    time.sleep(0.05)
    assert not os.path.exists(tmp_path / step_dir(3) / MANIFEST)  # rank 1 has not written yet
    h1 = r1.save(3, state(1))
    assert h0.result(timeout=30) == 3 and h1.result(timeout=30) == 3
    r0.close(), r1.close()
    a = f"{step_dir(3)}/{h0.attempt}"
    assert h0.attempt == h1.attempt and h0.attempt.startswith("job.")
    # the manifest is the commit; only the attempt's "committed" marker (for the other ranks) follows
    assert events[-2:] == [("put", f"{step_dir(3)}/{MANIFEST}"), ("put", f"{a}/committed")]
    assert set(events[:-2]) == {
        ("data", f"{a}/r00000.data"), ("data", f"{a}/r00001.data"),
        ("put", f"{a}/r00000.table"), ("put", f"{a}/r00001.table"),
        ("put", f"{a}/rec/g00000/r00001.json"),
    }
    tmp_name, final = [r for r in replaces if r[1].endswith(MANIFEST)][-1]
    assert os.path.basename(tmp_name).startswith(".manifest.json.")
    # two data files, two chunk tables and their folder, the manifest and its folder (records need none)
    assert len(fsyncs) == 8


def test_retention_keeps_the_newest_and_deletes_the_manifest_first(tmp_path, monkeypatch):
    removed = []
    real_remove, real_tree = Storage.remove, Storage.remove_tree
    monkeypatch.setattr(Storage, "remove", lambda self, rel: (removed.append(("file", rel)), real_remove(self, rel)))
    monkeypatch.setattr(Storage, "remove_tree", lambda self, rel: (removed.append(("tree", rel)), real_tree(self, rel)))
    with Checkpointer(str(tmp_path), keep_last=2) as ckpt:
        for step in range(1, 5):
            ckpt.save(step, {"w": torch.full((4,), float(step))}).result()
        ckpt.wait()
        assert ckpt.steps() == [3, 4]
    assert removed[:2] == [("file", f"{step_dir(1)}/{MANIFEST}"), ("tree", step_dir(1))]
    assert sorted(os.listdir(tmp_path)) == [step_dir(3), step_dir(4)]


def test_incomplete_checkpoints_are_never_loaded_and_are_cleaned_up(tmp_path):
    with Checkpointer(str(tmp_path)) as ckpt:
        ckpt.save(1, {"w": torch.ones(4)}).result()
        # a crash mid-save: data and a record but no manifest, at a newer step, untouched
        # for longer than commit_timeout (a fresh one may be another live job's save)
        os.makedirs(tmp_path / step_dir(2))
        (tmp_path / step_dir(2) / "x-r00000.data").write_bytes(b"\0" * 16)
        old = time.time() - ckpt.commit_timeout - 60
        os.utime(tmp_path / step_dir(2) / "x-r00000.data", (old, old))
        assert ckpt.latest_step() == 1 and ckpt.steps() == [1]
        target = {"w": torch.zeros(4)}
        assert ckpt.load(target) == 1
        with pytest.raises(LoadError, match="step 2 is not a committed checkpoint"):
            ckpt.load(target, step=2)
        ckpt.save(3, {"w": torch.ones(4)}).result()  # newer commit: the abandoned folder goes
        ckpt.wait()
    assert sorted(os.listdir(tmp_path)) == [step_dir(1), step_dir(3)]


def test_no_checkpoint_is_a_clear_error(tmp_path):
    with Checkpointer(str(tmp_path)) as ckpt:
        with pytest.raises(LoadError, match="no committed checkpoint"):
            ckpt.load({"w": torch.zeros(1)})
        assert ckpt.latest_step() is None


def test_a_damaged_chunk_fails_the_load_and_fallback_takes_the_previous_step(tmp_path):
    with Checkpointer(str(tmp_path), chunk_bytes=1024) as ckpt:
        ckpt.save(1, {"w": torch.full((1000,), 1.0)}).result()
        ckpt.save(2, {"w": torch.full((1000,), 2.0)}).result()
        path = data_path(tmp_path, 2, 0)
        raw = bytearray(path.read_bytes())
        raw[1500] ^= 0x01  # one flipped bit in the second chunk
        path.write_bytes(bytes(raw))
        target = {"w": torch.zeros(1000)}
        with pytest.raises(ChecksumError, match="checksum"):
            ckpt.load(target)
        assert ckpt.load(target, fallback=True) == 1
        assert torch.equal(target["w"], torch.full((1000,), 1.0))


def test_missing_and_unexpected_keys_are_named_unless_strict_is_off(tmp_path):
    with Checkpointer(str(tmp_path)) as ckpt:
        ckpt.save(1, {"a": torch.ones(2), "b": torch.ones(3), "n": 1}).result()
        with pytest.raises(StructureMismatch, match=r"no tensors \['c'\].*strict=False"):
            ckpt.load({"a": torch.zeros(2), "b": torch.zeros(3), "c": torch.zeros(1), "n": 0})
        with pytest.raises(StructureMismatch, match=r"holds tensors \['b'\]"):
            ckpt.load({"a": torch.zeros(2), "n": 0})
        target = {"a": torch.zeros(2), "c": torch.zeros(1), "n": 0}
        ckpt.load(target, strict=False)
        assert target["a"].tolist() == [1, 1] and target["c"].tolist() == [0] and target["n"] == 1
        stats = ckpt.last_load_stats
        assert stats.missing == ["c"] and stats.not_loaded == ["b"] and stats.skipped == ["b", "c"]


def test_dtype_and_shape_mismatches_name_the_tensor(tmp_path):
    with Checkpointer(str(tmp_path)) as ckpt:
        ckpt.save(1, {"w": torch.ones(2, 3)}).result()
        with pytest.raises(StructureMismatch, match=r"'w'.*float32 \[2, 3\].*float32 \[3, 2\]"):
            ckpt.load({"w": torch.zeros(3, 2)})
        with pytest.raises(StructureMismatch, match=r"'w'.*float64"):
            ckpt.load({"w": torch.zeros(2, 3, dtype=torch.float64)})


def test_unsupported_values_raise_at_save_with_the_key(tmp_path):
    with Checkpointer(str(tmp_path)) as ckpt:
        with pytest.raises(TypeError, match="'bad/x'.*object"):
            ckpt.save(1, {"bad": {"x": object()}})
        with pytest.raises(ValueError, match="step"):
            ckpt.save(-1, {"w": torch.ones(1)})


def test_loading_never_unpickles(tmp_path, monkeypatch):
    state = full_state()
    with Checkpointer(str(tmp_path)) as ckpt:
        ckpt.save(1, state).result()

        def forbidden(*a, **k):
            raise AssertionError("pickle used on the load path")

        monkeypatch.setattr(pickle, "loads", forbidden)
        monkeypatch.setattr(pickle, "load", forbidden)
        monkeypatch.setattr(pickle, "Unpickler", forbidden)
        monkeypatch.setattr(torch, "load", forbidden)
        target = empty_like_state()
        ckpt.load(target)
    assert_state_equal(state, target)


def test_a_failed_write_is_reported_on_the_handle_and_the_log_not_raised(tmp_path, monkeypatch, caplog):
    def broken(self, rel, parts, fsync=True):
        raise OSError(28, "No space left on device")

    with Checkpointer(str(tmp_path)) as ckpt:
        monkeypatch.setattr(Storage, "write_stream", broken)
        monkeypatch.setattr(Storage, "write_direct", lambda self, rel, data, nbytes, fsync=True: broken(self, rel, [data]))
        with caplog.at_level(logging.ERROR, logger="flexckpt"):
            h = ckpt.save(1, {"w": torch.ones(4)})  # does not raise
            h.wait_staged()
            with pytest.raises(SaveError, match="No space left"):
                h.result(timeout=10)
        assert isinstance(h.exception(), OSError)
        assert "save of step 1 failed while writing" in caplog.text
        monkeypatch.undo()
        assert ckpt.save(2, {"w": torch.ones(4)}).result(timeout=10) == 2  # the next save works
        assert ckpt.steps() == [2]


def test_max_in_flight_bounds_staging_buffers_and_the_wait_is_trainer_wait(tmp_path, monkeypatch):
    gate = threading.Event()
    real = Storage.write_stream

    def slow(self, rel, parts, fsync=True):
        gate.wait(10)
        return real(self, rel, parts, fsync)

    monkeypatch.setattr(Storage, "write_stream", slow)
    monkeypatch.setattr(Storage, "write_direct", lambda self, rel, data, nbytes, fsync=True: (gate.wait(10), False)[1])
    with Checkpointer(str(tmp_path), max_in_flight=1) as ckpt:
        ckpt.save(1, {"w": torch.ones(1 << 16)}).wait_staged()
        threading.Timer(0.3, gate.set).start()
        h2 = ckpt.save(2, {"w": torch.ones(1 << 16)})  # waits for the only buffer
        assert h2.save_seconds >= 0.25
        assert ckpt._pipeline.pool.in_use() <= 1
        assert h2.result(timeout=10) == 2


def test_structures_that_differ_between_ranks_fail_the_checkpoint_naming_the_keys(tmp_path):
    r0 = Checkpointer(str(tmp_path), rank=0, world_size=2, run_id="job", commit_timeout=20)
    r1 = Checkpointer(str(tmp_path), rank=1, world_size=2, run_id="job", commit_timeout=20)
    h0 = r0.save(1, {"a": torch.ones(4), "b": torch.ones(2)})
    h1 = r1.save(1, {"a": torch.ones(4), "c": torch.ones(2)})
    with pytest.raises(SaveError, match=r"only on rank 0: \['b'\].*only on the other rank: \['c'\]"):
        h0.result(timeout=30)
    with pytest.raises(SaveError, match="failed on another rank: rank 0 failed while committing.*different state"):
        h1.result(timeout=30)
    assert r0.steps() == []
    r0.close(), r1.close()


def test_records_of_an_earlier_job_cannot_complete_a_checkpoint(tmp_path):
    state = lambda r: {"w": ShardedTensor.from_global(torch.arange(8.0), Shard(0), r, 2)}  # noqa: E731
    stray = Checkpointer(str(tmp_path), rank=1, world_size=2, run_id="old-job")
    stray.save(5, state(1)).wait_staged()
    stray.close()
    r0 = Checkpointer(str(tmp_path), rank=0, world_size=2, run_id="new-job", commit_timeout=1.0)
    with pytest.raises(SaveError, match=r"record of ranks \[1\] missing.*commit_timeout"):
        r0.save(5, state(0)).result(timeout=30)
    assert r0.steps() == []
    # the real rank 1 arrives: the next save commits, and the stray's files are cleaned up
    r1 = Checkpointer(str(tmp_path), rank=1, world_size=2, run_id="new-job")
    h0, h1 = r0.save(6, state(0)), r1.save(6, state(1))
    assert h0.result(timeout=30) == 6 and h1.result(timeout=30) == 6
    r0.wait()  # retention runs after the commit
    assert r0.steps() == [6] and not (tmp_path / step_dir(5)).exists()
    r0.close(), r1.close()


def test_lane_values_are_merged_across_ranks_and_a_repeated_lane_must_be_equal(tmp_path):
    r0 = Checkpointer(str(tmp_path), rank=0, world_size=2, run_id="job", commit_timeout=20)
    r1 = Checkpointer(str(tmp_path), rank=1, world_size=2, run_id="job", commit_timeout=20)
    h0 = r0.save(1, {"data": ByLane({"0": 10, "1": 11}), "rng": PerRank(0)})
    h1 = r1.save(1, {"data": ByLane({"2": 12, "3": 13}), "rng": PerRank(1)})
    assert h0.result(timeout=30) == 1 and h1.result(timeout=30) == 1
    # a lane hosted by both ranks (TP peers of one replica): equal copies are stored once
    h0 = r0.save(2, {"data": ByLane({"0": {"doc": 5, "at": [1, 2]}}), "rng": PerRank(0)})
    h1 = r1.save(2, {"data": ByLane({"0": {"at": [1, 2], "doc": 5}}), "rng": PerRank(1)})
    assert h0.result(timeout=30) == 2 and h1.result(timeout=30) == 2
    h0 = r0.save(3, {"data": ByLane({"0": 10}), "rng": PerRank(0)})
    h1 = r1.save(3, {"data": ByLane({"0": 11}), "rng": PerRank(1)})
    with pytest.raises(SaveError, match="lane '0' of 'data' was saved by several ranks with different values"):
        h0.result(timeout=30)
    r0.close(), r1.close()
    with Checkpointer(str(tmp_path)) as solo:
        target = {"data": ByLane(), "rng": PerRank("untouched")}
        # per-rank values do not carry over to another world size: the load says so, and
        # goes on only without them
        with pytest.raises(StructureMismatch, match=r"per-rank values \['rng'\] .* world size 2 .* exclude=\('rng',\)"):
            solo.load(target, step=1)
        assert solo.load(target, step=1, exclude=("rng",)) == 1
        assert target["data"].values == {"0": 10, "1": 11, "2": 12, "3": 13}
        assert target["rng"].value == "untouched" and not target["rng"].restored
        assert solo.load(target, step=2, exclude=("rng",)) == 2
        assert target["data"].values == {"0": {"doc": 5, "at": [1, 2]}}


def test_memory_urls_refuse_multi_rank_jobs():
    with pytest.raises(ValueError, match="memory:// lives inside one process"):
        Checkpointer("memory://x", rank=0, world_size=2, run_id="j")


def test_bad_arguments_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="keep_last"):
        Checkpointer("memory://a", keep_last=0)
    with pytest.raises(ValueError, match="compression"):
        Checkpointer("memory://a", compression="lz4")
    with pytest.raises(ValueError, match="both rank= and world_size="):
        Checkpointer("memory://a", rank=0)
    with pytest.raises(ValueError, match="run_id"):
        Checkpointer("/tmp/x", rank=0, world_size=2)
    with pytest.raises(ValueError, match="max_in_flight"):
        Checkpointer("memory://a", max_in_flight=0)


def test_resharding_in_one_process_with_every_layout(tmp_path):
    """Ranks of a 3-rank save played in one process, loaded by 2 ranks with other layouts."""
    g = torch.Generator().manual_seed(3)
    glob = {"a": torch.randn(97, 5, generator=g), "b": torch.randn(70, generator=g), "c": torch.randn(64, 2, generator=g),
            "d": torch.randn(5, 5, generator=g)}
    src = {"a": Shard(0), "b": BlockShard(32), "c": Owned(2), "d": Replicate()}
    dst = {"a": BlockShard(32), "b": Owned(1), "c": Shard(0), "d": Shard(0)}
    cks = [Checkpointer(str(tmp_path), rank=r, world_size=3, run_id="j") for r in range(3)]
    handles = [ck.save(9, {k: ShardedTensor.from_global(v, src[k], r, 3) for k, v in glob.items()}) for r, ck in enumerate(cks)]
    assert [h.result(timeout=30) for h in handles] == [9, 9, 9]
    for ck in cks:
        ck.close()
    for r in range(2):
        with Checkpointer(str(tmp_path), rank=r, world_size=2, run_id="k") as ck:
            target = {k: ShardedTensor.empty(v.shape, dst[k], rank=r, world_size=2) for k, v in glob.items()}
            ck.load(target)
            for k, v in glob.items():
                assert torch.equal(target[k].local, ShardedTensor.from_global(v, dst[k], r, 2).local), k


def test_a_resharding_load_reads_little_more_than_it_keeps(tmp_path):
    """Saved by 2 ranks in 1 MiB pieces, loaded by 4: each rank wants half of each piece.
    Chunks of 1/16 of a piece (64 KiB here) bound the waste to the two chunks a wanted
    range can cut at its ends."""
    glob = {f"t{i}": torch.randn(524288 + 37 * i) for i in range(6)}  # ~2 MiB each, odd sizes
    cks = [Checkpointer(str(tmp_path), rank=r, world_size=2, run_id="j") for r in range(2)]
    hs = [ck.save(1, {k: ShardedTensor.from_global(v, Shard(0), r, 2) for k, v in glob.items()}) for r, ck in enumerate(cks)]
    assert [h.result(timeout=30) for h in hs] == [1, 1]
    for ck in cks:
        ck.close()
    for r in range(4):
        with Checkpointer(str(tmp_path), rank=r, world_size=4, run_id="k") as ck:
            target = {k: ShardedTensor.empty(v.shape, Shard(0), rank=r, world_size=4) for k, v in glob.items()}
            ck.load(target)
            kept = sum(t.local.numel() * 4 for t in target.values())
            assert all(torch.equal(target[k].local, ShardedTensor.from_global(v, Shard(0), r, 4).local) for k, v in glob.items())
            assert ck.last_load_stats.bytes_read <= kept + 2 * (64 << 10) * len(glob), (r, ck.last_load_stats, kept)


def test_an_unknown_url_scheme_is_named_with_the_schemes_that_work(tmp_path):
    with pytest.raises(ValueError, match=r"no storage knows the scheme 'foo'; use a local path, file://, memory:// or s3://"):
        Checkpointer("foo://bucket/run")
