"""Who saves: a Checkpointer made on one rank of many (``ranks=[0]``, the Lightning/DDP
pattern) works without the others; one made on every rank agrees on its ids through the
store, with no collective; the fast tier still needs every rank and names a missing one."""
import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist

from flexckpt import Checkpointer, SaveError
from flexckpt.tier import LocalTier
from flexshard import Shard, ShardedTensor
from flexshard.spawn import run_workers


def trainer_state(step: int) -> dict:
    return {"model": {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4) + step, "b": torch.full((4,), step)},
            "step": step, "lr": 0.5}


def empty_state() -> dict:
    return {"model": {"w": torch.zeros(3, 4), "b": torch.zeros(4, dtype=torch.int64)}, "step": 0, "lr": 0.0}


class _NoCollectives:
    """Inside: every collective of torch.distributed raises."""

    NAMES = ("broadcast", "all_reduce", "all_gather", "all_gather_object", "barrier", "new_group")

    def __enter__(self):
        self.saved = {n: getattr(dist, n) for n in self.NAMES}

        def refuse(*a, **k):
            raise AssertionError("a collective at construction")

        for n in self.NAMES:
            setattr(dist, n, refuse)

    def __exit__(self, *exc):
        for n, fn in self.saved.items():
            setattr(dist, n, fn)


def _rank0_saves_alone(rank: int, world: int, root: str) -> dict:
    out: dict = {}
    if rank == 0:
        t0 = time.monotonic()
        ck = Checkpointer(root, ranks=[0], commit_timeout=60)
        out["construct_s"] = time.monotonic() - t0
        out["world"] = (ck.rank, ck.world_size)
        t0 = time.monotonic()
        out["committed"] = ck.save(7, trainer_state(7)).result(timeout=10)
        out["commit_s"] = time.monotonic() - t0
        ck.close()
    dist.barrier()  # rank 1 waits here the whole time, as in a framework's barrier
    # every rank loads rank 0's full state: alone (ranks=[0]), then all together (the default)
    alone = Checkpointer(root, ranks=[0])
    out["reader_saves"] = alone.saves
    if rank == 1:
        with pytest.raises(RuntimeError, match="rank 1 does not save"):
            alone.save(8, trainer_state(8))
    got = empty_state()
    out["alone_step"] = alone.load(got)
    out["alone"] = got
    alone.close()
    with _NoCollectives():  # on every rank: ids agreed through the store, in construction order
        first, together = Checkpointer(root), Checkpointer(root)
    out["ids"] = [(c.run_id, c.session) for c in (first, together)]
    first.close()
    got = empty_state()
    out["together_step"] = together.load(got)
    out["together"] = got
    sharded = empty_state()  # each rank its rows of w, per the layout (3 rows: 2 on rank 0, 1 on rank 1)
    sharded["model"]["w"] = ShardedTensor.from_global(torch.zeros(3, 4), Shard(0), rank, world)
    together.load(sharded)
    out["rows"] = sharded["model"]["w"].local.clone()
    together.close()
    return out


def test_rank0_saves_alone_while_rank1_waits_in_a_barrier_then_every_rank_loads(tmp_path):
    r0, r1 = run_workers(_rank0_saves_alone, 2, str(tmp_path / "ck"), timeout=90)
    assert r0["construct_s"] < 2.0, r0  # returns at once: no rank-1 agreement (noisy 2-core host)
    assert r0["world"] == (0, 1)
    assert r0["committed"] == 7 and r0["commit_s"] < 10.0, r0
    assert (r0["reader_saves"], r1["reader_saves"]) == (True, False)
    want = trainer_state(7)
    for r in (r0, r1):
        assert r["alone_step"] == 7 and r["together_step"] == 7
        for got in (r["alone"], r["together"]):
            assert torch.equal(got["model"]["w"], want["model"]["w"])
            assert torch.equal(got["model"]["b"], want["model"]["b"])
            assert (got["step"], got["lr"]) == (7, 0.5)
    assert torch.equal(r0["rows"], want["model"]["w"][:2]) and torch.equal(r1["rows"], want["model"]["w"][2:])
    assert r0["ids"] == r1["ids"] and len(set(r0["ids"])) == 2  # agreed, and fresh per construction


def _missing_ranks_time_out(rank: int, world: int, root: str, shm: str) -> str:
    """Rank 1 constructs while rank 0 does not; then rank 0 constructs and saves while rank 1 does
    not (without ranks=: the commit times out suggesting it), and makes a fast tier."""
    msg = ""
    if rank == 1:
        with pytest.raises(TimeoutError) as err:
            Checkpointer(root, commit_timeout=1)
        msg = str(err.value)
    dist.barrier()
    store = dist.distributed_c10d._get_default_store()
    if rank == 1:  # alive, but never constructs: the missing peer, until rank 0 is done
        store.wait(["test/done"], datetime.timedelta(seconds=30))
        return msg
    tier = LocalTier(dir=os.path.join(shm, "{node}"), timeout=2)
    with pytest.raises(ValueError, match=r"local=.*ranks=\[0\] leaves some out"):
        Checkpointer(root, ranks=[0], local=tier)
    t0 = time.monotonic()
    alone = Checkpointer(root, commit_timeout=1)  # without ranks=: returns at once all the same
    assert time.monotonic() - t0 < 2.0  # noisy 2-core host
    with pytest.raises(SaveError, match=r"missing .* is every rank calling save\(\).*ranks=\[0\]"):
        alone.save(1, trainer_state(1)).result(timeout=30)  # the commit waits for rank 1's record
    alone.close()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as err:
        Checkpointer(root, local=tier)
    assert time.monotonic() - t0 < 10
    store.set("test/done", "1")
    return str(err.value)


def test_a_missing_rank_ends_in_a_timeout_that_names_it(tmp_path):
    tier, ids = run_workers(_missing_ranks_time_out, 2, str(tmp_path / "ck"), str(tmp_path / "shm"), timeout=60)
    assert "waited 1 s (commit_timeout) for global rank 0" in ids and "ranks=" in ids, ids
    assert "local=" in tier and "global rank(s) [1] did not construct" in tier, tier


def test_ranks_names_the_saving_ranks_and_refuses_what_it_cannot_do():
    from flexckpt.save.savers import Savers, _check_ranks, run_ids, who_saves

    # no torch.distributed: a group of one
    assert who_saves(None, None, [0], None) == Savers(0, 1, True, True, (), (0,), False)
    assert who_saves(None, None, None, None) == Savers(0, 1, True, True)
    with pytest.raises(ValueError, match=r"ranks= must name distinct ranks in \[0, 1\).*\[1\]"):
        who_saves(None, None, [1], None)
    with pytest.raises(ValueError, match="not both"):
        who_saves(0, 1, [0], None)
    with pytest.raises(ValueError, match="a list of group ranks"):
        who_saves(None, None, 0, None)
    run_id, session = run_ids("job", who_saves(None, None, [0], None), 1.0)
    assert run_id == "job" and len(session) == 8
    with pytest.raises(ValueError, match=r"names 2 of 4 ranks.*new_group\(\[0, 2\]\)"):
        _check_ranks([2, 0], 4)
    assert _check_ranks([3], 4) == (3,) and _check_ranks([3, 1, 0, 2], 4) == (0, 1, 2, 3)
