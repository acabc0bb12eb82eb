"""Who saves: a Checkpointer made on one rank of many (``ranks=[0]``, the Lightning/DDP
pattern) works without the others; one made on every rank agrees on its ids through the
store, with no collective; the fast tier still needs every rank and names a missing one."""
import os
import time

import pytest
import torch
import torch.distributed as dist

from flexckpt import Checkpointer
from flexckpt.savers import Savers, run_ids, savers
from flexckpt.tier import LocalTier
from flexshard.spawn import WorkerError, run_workers


def trainer_state(step: int) -> dict:
    return {"model": {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4) + step, "b": torch.full((4,), step)},
            "step": step, "lr": 0.5}


def empty_state() -> dict:
    return {"model": {"w": torch.zeros(3, 4), "b": torch.zeros(4, dtype=torch.int64)}, "step": 0, "lr": 0.0}


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
    together = Checkpointer(root)
    got = empty_state()
    out["together_step"] = together.load(got)
    out["together"] = got
    out["ids"] = (together.run_id, together.session)
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
    assert r0["ids"] == r1["ids"]  # constructed on every rank: agreed through the store


def _no_collective_at_construction(rank: int, world: int, root: str) -> list:
    def refuse(*a, **k):
        raise AssertionError("a collective at construction")

    dist.broadcast = dist.all_reduce = dist.all_gather_object = dist.barrier = refuse
    ids = []
    for _ in range(3):  # in order: each construction pairs with the same one on the other rank
        ck = Checkpointer(root, commit_timeout=30)
        ids.append((ck.run_id, ck.session))
        ck.close()
    return ids


def test_every_rank_construction_agrees_on_ids_through_the_store_without_collectives(tmp_path):
    r0, r1 = run_workers(_no_collective_at_construction, 2, str(tmp_path / "ck"), timeout=60)
    assert r0 == r1
    assert len(set(r0)) == 3  # a fresh run id and session per construction


def _rank1_alone_times_out(rank: int, world: int, root: str) -> str:
    if rank == 0:
        return ""
    with pytest.raises(TimeoutError) as err:
        Checkpointer(root, commit_timeout=1)
    return str(err.value)


def test_a_rank_waiting_for_the_first_rank_s_ids_times_out_naming_it(tmp_path):
    _, msg = run_workers(_rank1_alone_times_out, 2, str(tmp_path / "ck"), timeout=60)
    assert "global rank 0" in msg and "ranks=" in msg, msg


def _tier_without_peer(rank: int, world: int, root: str, shm: str) -> str:
    if rank == 1:
        time.sleep(4)  # alive, but never constructs: the missing peer
        return ""
    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as err:
        Checkpointer(root, local=LocalTier(dir=os.path.join(shm, "{node}"), timeout=2))
    assert time.monotonic() - t0 < 10
    return str(err.value)


def test_fast_tier_with_a_missing_peer_times_out_naming_it(tmp_path):
    msg, _ = run_workers(_tier_without_peer, 2, str(tmp_path / "ck"), str(tmp_path / "shm"), timeout=60)
    assert "global rank(s) [1] did not construct" in msg and "local=" in msg, msg


def test_ranks_names_the_saving_ranks_and_refuses_what_it_cannot_do():
    # no torch.distributed: a group of one
    assert savers(None, None, [0], None) == Savers(0, 1, True, True, (), (0,), False)
    assert savers(None, None, None, None) == Savers(0, 1, True, True)
    with pytest.raises(ValueError, match=r"ranks= must name distinct ranks in \[0, 1\).*\[1\]"):
        savers(None, None, [1], None)
    with pytest.raises(ValueError, match="not both"):
        savers(0, 1, [0], None)
    with pytest.raises(ValueError, match="a list of group ranks"):
        savers(None, None, 0, None)
    run_id, session = run_ids("job", savers(None, None, [0], None), 1.0)
    assert run_id == "job" and len(session) == 8
    from flexckpt.savers import _check_ranks

    with pytest.raises(ValueError, match=r"names 2 of 4 ranks.*new_group\(\[0, 2\]\)"):
        _check_ranks([2, 0], 4)
    assert _check_ranks([3], 4) == (3,) and _check_ranks([3, 1, 0, 2], 4) == (0, 1, 2, 3)
