"""The process launcher every multi-process test relies on: results, errors and hangs."""
import time

import pytest
import torch
import torch.distributed as dist

from flexshard.spawn import WorkerError, run_workers


def _sum_ranks(rank, world):
    t = torch.tensor([rank + 1])
    dist.all_reduce(t)
    return rank, world, int(t.item())


def _fail_on_rank_one(rank, world):
    if rank == 1:
        raise ValueError("rank one is broken")
    time.sleep(60)  # the others would wait forever: the launcher must not


def _hang(rank, world):
    time.sleep(60)


def test_run_workers_returns_results_in_rank_order():
    assert run_workers(_sum_ranks, 2, timeout=60) == [(0, 2, 3), (1, 2, 3)]


def test_one_failing_rank_fails_the_run_with_its_error():
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match="rank 1 of 2 failed(.|\n)*rank one is broken"):
        run_workers(_fail_on_rank_one, 2, timeout=60)
    assert time.monotonic() - t0 < 30


def test_a_hanging_group_times_out():
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\]"):
        run_workers(_hang, 2, timeout=1, backend="none")
