"""A fast-tier save of the step a persistent save just took reads that save's staged buffer
(one walk, one staging copy), so the buffer has two holders: the next staging into it
waits until the fast tier has copied it into the node's file. These tests change the state
right after the fence and check that both tiers hold the saved values bit-exact."""
import os
import threading
import time

import pytest
import torch

from flexckpt import Checkpointer
from flexckpt.errors import SaveError
from flexckpt.format.names import data_name, step_dir, table_name
from flexckpt.save.staging import BufferPool, HostCopies
import flexckpt.save.writer as writer
from flexckpt.tier import LocalTier
import flexckpt.tier.fast as fast
from flexshard import Shard, ShardedTensor

SHAPES = {"a": (64, 48), "b": (300,), "c": (17, 5)}


def global_tensor(name: str, step: int) -> torch.Tensor:
    """Distinct values per tensor and step (exact in float32)."""
    shape = SHAPES[name]
    n = torch.Size(shape).numel()
    return (torch.arange(n, dtype=torch.float32) * 3 + 1000 * sorted(SHAPES).index(name) + step).reshape(shape)


def make_state(step: int, rank: int = 0, world: int = 1) -> dict:
    state: dict = {n: ShardedTensor.from_global(global_tensor(n, step), Shard(0), rank, world) for n in SHAPES}
    state["meta"] = {"step": step}
    return state


def bump(state: dict) -> None:
    """The optimizer step: every tensor changes in place, and the plain value too."""
    for name in SHAPES:
        state[name].local.add_(1)
    state["meta"]["step"] += 1


def checkpointer(tmp_path, keep_last: int = 3, stage_delay: float = 1.0) -> Checkpointer:
    tier = LocalTier(dir=str(tmp_path / "node" / "{node}"), replicas=0, keep_last=keep_last, lineage="reuse-test",
                     stale_after=0)
    # staging waits for the fence (stage_delay): a save_local() right after save() always finds its buffer held
    return Checkpointer(str(tmp_path / "store"), rank=0, world_size=1, local=tier, fsync=False, chunk_bytes=4096,
                        stage_delay=stage_delay)


def slow_tier_writes(monkeypatch, ck: Checkpointer, seconds: float) -> list:
    """Each fast save pauses before it reads the staged bytes into the node's data file
    (what a loaded machine does); returns the list of pauses taken."""
    real, taken = ck.tier.storage.write_stream, []

    def slow(rel, parts, fsync=True):
        if rel.endswith(".data"):
            taken.append(seconds)
            time.sleep(seconds)
        return real(rel, parts, fsync)

    monkeypatch.setattr(ck.tier.storage, "write_stream", slow)
    return taken


def file_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def test_shared_staging_holds_the_saved_bytes_in_both_tiers_when_the_state_changes_at_once(tmp_path, monkeypatch):
    walks = []
    real_walk = fast.walk
    monkeypatch.setattr(fast, "walk", lambda *a, **k: walks.append(1) or real_walk(*a, **k))
    hashed = []
    real_checksum = writer.checksum
    monkeypatch.setattr(writer, "checksum", lambda b: hashed.append(memoryview(b).nbytes) or real_checksum(b))
    ck = checkpointer(tmp_path)
    taken = slow_tier_writes(monkeypatch, ck, 0.3)
    state = make_state(1)
    handles, fast_saves = {}, {}
    try:
        for step in (1, 2, 3, 4, 5):
            if step % 2:
                ck.tier.wait(30)  # the last fast save is done: the next is not skipped
            h = handles[step] = ck.save(step, state)
            if step % 2:  # and a fast save of the same step, from the same staged bytes
                hf = fast_saves[step] = ck.save_local(step, state)
                assert hf is not None
                hf.wait_staged()  # the fast save's fence is the persistent save's
                assert h.staged()
            h.wait_staged()
            bump(state)  # at once: the tier has not read the buffer yet (its write is 0.3 s away)
        for step, h in handles.items():
            assert h.result(30) == step
        for step, hf in fast_saves.items():
            assert hf.result(30) == step
        assert len(taken) == 3 and walks == []  # one walk per step, the persistent save's
        assert ck.tier._buffer.data is None  # the tier never staged a copy of its own
        assert ck._pipeline.pool.in_use() == 0
        assert sum(hashed) == 5 * ck._pipeline._plan_entry.rank_plan.nbytes  # each step's chunks hashed once, for both tiers
        store = str(tmp_path / "store")
        for step, hf in fast_saves.items():  # the tier's files are byte for byte the persistent ones
            folder, attempt = step_dir(step), handles[step].attempt
            for name in (data_name, table_name):
                local = file_bytes(ck.tier.storage.path(f"{folder}/{name(hf.attempt, 0)}"))
                assert local == file_bytes(os.path.join(store, folder, name(attempt, 0))), (step, name.__name__)
            assert len(local) > 0
        # the next staging into the buffer waited for the fast tier to let go of it
        assert handles[2].timings["buffer_wait_s"] > 0.1
        assert handles[4].timings["buffer_wait_s"] > 0.1
        # the fast tier restores its newest step from its own files, values included
        target = make_state(0)
        assert ck.load(target) == 5
        assert ck.tier.last_recovery.source == "tier"
        for name in SHAPES:
            assert torch.equal(target[name].local, make_state(5)[name].local), name
        assert target["meta"] == {"step": 5}
        for step, h in handles.items():  # each persistent step holds exactly that step's state (load(step=)
            # sets the tier's steps aside: the run would go on from it)
            target = make_state(0)
            assert ck.load(target, step=step) == step
            want = make_state(step)
            for name in SHAPES:
                assert torch.equal(target[name].local, want[name].local), (step, name)
            assert target["meta"] == {"step": step}
    finally:
        ck.close()


def test_a_fast_save_alone_or_of_another_state_stages_its_own_copy(tmp_path):
    ck = checkpointer(tmp_path, stage_delay=0.0)
    try:
        state = make_state(4)
        ck.save(4, state).result(30)  # written and released: nothing left to share
        hf = ck.save_local(4, state)
        assert hf.result(30) == 4 and ck.tier._buffer.data is not None
        ck.tier._buffer.data = None
        h = ck.save(5, make_state(5))
        other = make_state(5)  # the same values, another object: never taken for the saved one
        hf = ck.save_local(5, other)
        bump(other)
        hf.wait_staged()
        assert h.result(30) == hf.result(30) == 5
        assert ck.tier._buffer.data is not None
        hf = ck.save_local(6, make_state(6))  # no persistent save of step 6
        assert hf.result(30) == 6
        assert ck._pipeline.pool.in_use() == 0
        target = make_state(0)
        assert ck.load(target) == 6 and ck.tier.last_recovery.source == "tier"
        assert torch.equal(target["a"].local, make_state(6)["a"].local)
    finally:
        ck.close()


def test_a_skipped_fast_save_holds_no_buffer(tmp_path, monkeypatch):
    ck = checkpointer(tmp_path)
    slow_tier_writes(monkeypatch, ck, 0.5)
    try:
        first = ck.save_local(1, make_state(1))  # busy for 0.5 s
        state = make_state(2)
        h = ck.save(2, state)
        assert ck.save_local(2, state) is None and ck.tier.skipped == 1
        h.wait_staged()
        assert h.result(30) == 2 and not first.done()
        assert ck._pipeline.pool.in_use() == 0  # released by the persistent save alone
        assert first.result(30) == 1
    finally:
        ck.close()


def test_a_fast_save_started_as_the_last_one_ends_is_not_taken_for_done(tmp_path, monkeypatch):
    real = fast.FastTier._save_one

    def tidy_slowly(self, job):
        real(self, job)
        time.sleep(0.3)  # the thread's own tidying after the handle said done (a mapping unmapped)

    monkeypatch.setattr(fast.FastTier, "_save_one", tidy_slowly)
    ck = checkpointer(tmp_path, stage_delay=0.0)
    slow_tier_writes(monkeypatch, ck, 0.5)
    try:
        assert ck.save_local(1, make_state(1)).result(30) == 1
        second = ck.save_local(2, make_state(2))  # while the thread still tidies up after step 1
        assert second is not None
        time.sleep(0.4)  # the tidying is over; step 2's write (0.5 s) is not
        assert not second.done()
        assert ck.save_local(3, make_state(3)) is None and ck.tier.skipped == 1  # still in flight: skipped
        assert second.result(30) == 2
    finally:
        ck.close()


def test_a_failed_persistent_staging_fails_the_fast_save_that_shares_it(tmp_path, monkeypatch):
    ck = checkpointer(tmp_path)
    real = HostCopies.copy
    calls = []

    def broken(self, dsts, srcs, ready=None):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("staging copy broke")
        return real(self, dsts, srcs, ready)

    monkeypatch.setattr(HostCopies, "copy", broken)
    try:
        state = make_state(1)
        h = ck.save(1, state)
        hf = ck.save_local(1, state)
        assert hf.wait_staged(30)
        with pytest.raises(SaveError, match="staging copy broke"):
            h.result(30)
        with pytest.raises(SaveError, match="the persistent save of step 1, whose staged bytes this fast save takes, "
                                            "failed while staging: .*staging copy broke"):
            hf.result(30)
        assert ck._pipeline.pool.in_use() == 0
        assert ck.save_local(2, make_state(2)).result(30) == 2  # the tier goes on
    finally:
        ck.close()


def test_pool_buffer_returns_only_after_its_last_holder():
    pool = BufferPool(1)
    buf = pool.acquire()
    lease = buf.lease
    assert pool.share(buf, lease) and not pool.share(buf, lease - 1)
    pool.release(buf)
    assert pool.in_use() == 1
    got = []
    t = threading.Thread(target=lambda: got.append(pool.acquire()), daemon=True)
    t.start()
    t.join(0.2)
    assert got == []  # the second holder still reads it
    pool.release(buf)
    t.join(10)
    assert got == [buf] and buf.lease == lease + 1
    assert not pool.share(buf, lease)  # it holds another save now
    pool.release(buf)
    assert pool.in_use() == 0 and not pool.share(buf, buf.lease)

