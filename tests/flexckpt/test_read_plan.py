"""The read plan over columns (read_plan.file_plan, requests_of: requests, read groups, scatter) against
the computation it replaced, one object a chunk and a copy (the reference, in
tests/helpers/read_plan_reference.py and below),
over random plans: the same chunks, the same bytes to the same places, the same requests
and read groups; and a load simulated from the plan's lists alone rebuilds every target."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from flexckpt.errors import ManifestError
from flexckpt.format.checksum import digest, digest_parts
from flexckpt.format.manifest import FileEntry, StoredChunk
from flexckpt.format.manifest_parse import parse_manifest
from flexckpt.load.read_plan import SINK, file_plan, gather_runs, plan_requests, requests_of
from flexckpt.state.structure import TensorSpec
from flexshard import BlockShard, FlatRange, Owned, Part, Replicate, Shard
from flexshard.box import Box, box_part, whole
from manifest_v1_writer import random_specs, save_in_memory, shapes_st, v1_manifest_bytes
from read_plan_reference import ChunkRead, Copy, coalesce


# -- the reference: the slow computation the columns replaced -----------------------------------
def _reference_reads(file, chunks, starts, nbytes, dest, dest_pos):
    """Each run cut at the chunks' bounds, one StoredChunk and one Copy at a time."""
    out = {}
    for s, n, t, tp in zip(starts.tolist(), nbytes.tolist(), dest.tolist(), dest_pos.tolist()):
        for i, c in enumerate(chunks):
            lo, hi = max(s, c.raw_offset), min(s + n, c.raw_offset + c.raw_length)
            if lo < hi:
                out.setdefault(i, []).append(Copy(lo - c.raw_offset, hi - lo, t, tp + lo - s))
    return [(i, ChunkRead(file, chunks[i], tuple(out[i]))) for i in sorted(out)]


def _reference_places(reads):
    """The places the old fetch loop read each chunk into: its copies by position in the
    chunk, the bytes between and after them into a sink (positions counted over the file)."""
    places, used = [], 0
    for cr in reads:
        pos, mine = 0, []
        for cp in sorted(cr.copies, key=lambda cp: cp.chunk_pos):
            if cp.chunk_pos > pos:
                mine.append((SINK, used, cp.chunk_pos - pos))
                used += cp.chunk_pos - pos
            mine.append((cp.target, cp.target_pos, cp.nbytes))
            pos = cp.chunk_pos + cp.nbytes
        if pos < cr.chunk.raw_length:
            mine.append((SINK, used, cr.chunk.raw_length - pos))
            used += cr.chunk.raw_length - pos
        places.append(mine)
    return places


def _reference_groups(lengths, group_bytes):
    """The old loop: a group closes once it reaches ``group_bytes``, and at the end."""
    ends, total = [], 0
    for k, n in enumerate(lengths):
        total += n
        if total >= group_bytes or k == len(lengths) - 1:
            ends.append(k + 1)
            total = 0
    return ends


def _random_load(shapes, src_world, dst_world, dst_rank, chunk, seed):
    specs = random_specs(shapes, src_world)
    gen = torch.Generator().manual_seed(seed)
    globals_ = {s.name: torch.randint(0, 100, s.shape, generator=gen).to(s.dtype) for s in specs}
    manifest, streams = save_in_memory(globals_, specs, src_world, chunk)
    manifest = parse_manifest(v1_manifest_bytes(manifest))
    targets = []
    for i, s in enumerate(sorted(specs, key=lambda s: s.name)):
        layout = [Shard(0), BlockShard(3), Replicate(), Owned((i + 1) % dst_world)][i % 4]
        rng = layout.flat_range(s.shape, dst_world, dst_rank)
        if len(rng):
            targets.append((manifest.tensors[s.name], rng))
    return globals_, manifest, streams, targets


load_st = dict(shapes=shapes_st, src_world=st.integers(1, 5), dst_world=st.integers(1, 5), dst_rank=st.integers(0, 4),
               chunk=st.sampled_from([64, 256, 4096]), seed=st.integers(0, 3))


@settings(max_examples=120, deadline=None)
@given(**load_st)
def test_file_plan_tiles_each_chunk_with_the_places_the_object_computation_gave(shapes, src_world, dst_world, dst_rank,
                                                                              chunk, seed):
    _, manifest, _, targets = _random_load(shapes, src_world, dst_world, dst_rank % dst_world, chunk, seed)
    for file, cols in gather_runs(targets).items():
        entry = manifest.files[file]
        ref = _reference_reads(file, entry.chunks, *cols)
        plan = file_plan(file, entry, cols)
        assert plan.ids.tolist() == [i for i, _ in ref]
        got = [list(zip(plan.seg_dest[a:b].tolist(), plan.seg_pos[a:b].tolist(), plan.seg_len[a:b].tolist()))
               for a, b in zip(plan.seg_first[:-1].tolist(), plan.seg_first[1:].tolist())]
        assert got == _reference_places([cr for _, cr in ref])
        assert plan.direct.tolist() == [all(d != SINK for d, _, _ in p) for p in got]
        # the copies, by position in each chunk, are the reference's
        copies = [sorted(cr.copies, key=lambda c: c.chunk_pos) for _, cr in ref]
        first = plan.copy_first.tolist()
        assert [list(map(Copy, plan.copy_chunk_pos[a:b].tolist(), plan.copy_nbytes[a:b].tolist(),
                         plan.copy_dest[a:b].tolist(), plan.copy_dest_pos[a:b].tolist()))
                for a, b in zip(first[:-1], first[1:])] == copies


@settings(max_examples=120, deadline=None)
@given(**load_st, max_bytes=st.sampled_from([1, 100, 700, 4096, 1 << 20]))
def test_requests_are_the_fetches_coalesce_makes(shapes, src_world, dst_world, dst_rank, chunk, seed, max_bytes):
    _, manifest, _, targets = _random_load(shapes, src_world, dst_world, dst_rank % dst_world, chunk, seed)
    ref = []
    for file, cols in sorted(gather_runs(targets).items()):
        ref += [cr for _, cr in _reference_reads(file, manifest.files[file].chunks, *cols)]
    want = [(f.file, f.offset, f.length, [cr.chunk.offset for cr in f.reads]) for f in coalesce(ref, max_bytes)]
    got = [(r.plan.file, r.offset, r.length, r.plan.entry.offsets[r.plan.ids[r.first : r.stop]].tolist())
           for r in plan_requests(manifest, targets, max_bytes)]
    assert got == want


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(0, 900), min_size=1, max_size=40), cuts=st.sets(st.integers(1, 39)),
       group_bytes=st.sampled_from([1, 300, 512, 2000]))
def test_read_groups_close_a_group_once_it_reaches_the_size_as_the_loop_did(lengths, cuts, group_bytes):
    stops = sorted({c for c in cuts if c < len(lengths)} | {len(lengths)})
    want = [[a + e for e in _reference_groups(lengths[a:b], group_bytes)] for a, b in zip([0, *stops], stops)]
    assert _read_groups(lengths, stops, group_bytes) == want


def test_read_groups_of_the_load_loop_test():
    # 16 chunks of 128 KiB: 4 groups at 512 KiB; groups of 3 chunks (and a last of 1) at 300 KiB
    assert _read_groups([128 << 10] * 16, [16], 512 << 10) == [[4, 8, 12, 16]]
    assert _read_groups([128 << 10] * 16, [16], 300 << 10) == [[3, 6, 9, 12, 15, 16]]


def _read_groups(lengths, stops, group_bytes):
    """Each request's group ends as the load cuts them (requests_of), for a file of chunks
    of stored ``lengths``, each wanted whole (one raw byte a chunk), cut into requests that
    end at ``stops`` by the chunks' labels (as a fanned-out load's batches cut them)."""
    n = len(lengths)
    entry = FileEntry.from_columns("f", n, np.arange(n), np.ones(n, dtype=np.int64),
                                   np.concatenate(([0], np.cumsum(lengths)[:-1])), np.array(lengths), "zstd",
                                   np.zeros(n, dtype=np.uint64))
    plan = file_plan("f", entry, [np.array([v], dtype=np.int64) for v in (0, n, 0, 0)])
    labels = np.searchsorted(stops, np.arange(n), "right")  # request k's chunks: label k
    reqs = requests_of([plan], 1 << 62, group_bytes, {"f": labels})
    assert [r.stop for r in reqs] == stops
    return [[end for end, _ in r.groups] for r in reqs]


def _simulate(manifest, streams, targets, max_bytes, group_bytes):
    """The fetch loop on in-memory streams, from the Scatter lists alone: each group's bytes
    read in file order into its places, then its chunks checked against the table."""
    out = [bytearray(len(rng) * t.dtype.itemsize) for t, rng in targets]
    checked = 0
    for r in plan_requests(manifest, targets, max_bytes, group_bytes):
        sc = r.scatter
        bufs = [memoryview(b) for b in out] + [memoryview(bytearray(r.sink_bytes))]
        stream = streams[r.plan.file]
        first, x = r.first, r.place_start
        for end, place_end in r.groups:
            pos = sc.offsets[first]
            for d, p, n in zip(sc.place_dest[x:place_end], sc.place_pos[x:place_end], sc.place_len[x:place_end]):
                bufs[d][p : p + n] = stream[pos : pos + n]
                pos += n
            assert pos == sc.offsets[end - 1] + manifest.files[r.plan.file].lengths[r.plan.ids[end - 1]]
            for k in range(first, end):  # as the load verifies: a chunk of several segments over each
                d, p, n = sc.first_dest[k], sc.first_pos[k], sc.first_len[k]
                if sc.multi[k]:
                    a, b = sc.seg_first[k], sc.seg_first[k + 1]
                    parts = [bufs[d][p : p + n] for d, p, n in zip(sc.seg_dest[a:b], sc.seg_pos[a:b], sc.seg_len[a:b])]
                    assert len(parts) > 1 and sum(len(x) for x in parts) == manifest.files[r.plan.file].raw_lengths[
                        r.plan.ids[k]] and (sc.seg_dest[a], sc.seg_pos[a], sc.seg_len[a]) == (d, p, n)
                    assert digest_parts(parts) == sc.checks[k]
                else:
                    assert n == manifest.files[r.plan.file].raw_lengths[r.plan.ids[k]] and d != SINK
                    assert digest(bufs[d][p : p + n]) == sc.checks[k]
                checked += 1
            first, x = end, place_end
    return out, checked


@settings(max_examples=100, deadline=None)
@given(**load_st, max_bytes=st.sampled_from([100, 4096, 1 << 20]), group_bytes=st.sampled_from([1, 300, 1 << 19]))
def test_a_load_from_the_scatter_lists_alone_rebuilds_every_target_and_checks_every_chunk(
        shapes, src_world, dst_world, dst_rank, chunk, seed, max_bytes, group_bytes):
    globals_, manifest, streams, targets = _random_load(shapes, src_world, dst_world, dst_rank % dst_world, chunk, seed)
    out, checked = _simulate(manifest, streams, targets, max_bytes, group_bytes)
    for (t, rng), got in zip(targets, out):
        want = globals_[t.name].reshape(-1)[rng.start : rng.stop].contiguous().view(torch.uint8).numpy().tobytes()
        assert bytes(got) == want, t.name
    assert checked == sum(len(file_plan(f, manifest.files[f], c).ids) for f, c in gather_runs(targets).items())


def test_a_request_straddling_a_partial_chunk_reads_the_rest_of_it_into_its_own_sink():
    # 4096 floats saved at world 1 in chunks of 1 KiB; elements 100..4095 and 0..99 wanted by
    # two targets, so chunk 0 has two copies; then 300..700 only: chunks 1 and 2, each with a gap
    spec = TensorSpec("big", torch.float32, (4096,), Shard(0))
    manifest, _ = save_in_memory({"big": torch.arange(4096.0)}, [spec], 1, 1024)
    t = manifest.tensors["big"]
    (r,) = plan_requests(manifest, [(t, FlatRange(100, 4096)), (t, FlatRange(0, 100))], 1 << 20, 1 << 20)
    sc = r.scatter
    assert r.sink_bytes == 0 and sc.multi[0] and not any(sc.multi[1:]) and sc.sunk_before[-1] == 0
    assert list(zip(sc.place_dest, sc.place_pos, sc.place_len))[:2] == [(1, 0, 400), (0, 0, 16384 - 400)]
    (r,) = plan_requests(manifest, [(t, FlatRange(300, 700))], 1 << 20, 1 << 20)
    assert (r.offset, r.length, r.sink_bytes) == (1024, 2048, 2048 - 1600)
    assert list(zip(r.scatter.place_dest, r.scatter.place_pos, r.scatter.place_len)) == [
        (SINK, 0, 176), (0, 0, 1600), (SINK, 176, 272)]


def test_runs_that_overlap_in_a_chunk_are_refused_naming_the_chunk():
    entry = FileEntry("f", 64, (StoredChunk(0, 32, 0, 32, "none", "0" * 16), StoredChunk(32, 32, 32, 32, "none", "0" * 16)))
    cols = [np.array(c, dtype=np.int64) for c in ([40, 36], [8, 8], [0, 1], [0, 0])]
    with pytest.raises(ManifestError, match="overlap in the chunk at raw byte 32"):
        file_plan("f", entry, cols)


def test_a_file_entry_from_columns_is_the_one_from_its_chunks():
    chunks = (StoredChunk(0, 100, 0, 40, "zstd", "00000000000000ff"),
              StoredChunk(100, 28, 40, 28, "none", "0123456789abcdef"))
    a = FileEntry("f", 128, chunks)
    b = FileEntry.from_columns("f", 128, [0, 100], [100, 28], [0, 40], [40, 28], "zstd",
                               np.array([0xFF, 0x0123456789ABCDEF], dtype=np.uint64))
    assert a.chunks == chunks and a.checksums.tolist() == [0xFF, 0x0123456789ABCDEF]
    assert a != b  # the second chunk's codec differs
    b.codec_ids[1] = 0
    assert a == b and b.chunks == chunks and len(b) == 2
    assert requests_of([file_plan("f", a, [np.array([v]) for v in (0, 128, 0, 0)])], 1 << 20)[0][3:5] == (0, 68)
    assert requests_of([file_plan("f", a, [np.array([], dtype=np.int64)] * 4)], 1 << 20, 1) == []


@settings(max_examples=150, deadline=None)
@given(shapes=shapes_st, src_world=st.integers(1, 6), dst_world=st.integers(1, 5), dst_rank=st.integers(0, 4),
       chunk=st.sampled_from([64, 4096]), hybrid=st.booleans())
def test_a_version_2_flat_want_gathers_the_runs_the_pieces_give(shapes, src_world, dst_world, dst_rank, chunk, hybrid):
    """gather_runs' shortcut for a flat range of a version-2 tensor (its writers' spans as
    columns, a row split's computed for all the wants at once) against the same tensor with
    its pieces listed (the general path): the same runs in each file, in the same order,
    with wants of a box (the general path either way) among them."""
    from flexckpt.format.manifest import PlanPieces
    from flexckpt.format.manifest_parse import _saved_tensor
    from flexckpt.format.write_plan import make_write_plan
    from flexshard import HybridShard

    specs = random_specs(shapes, src_world)
    if hybrid and src_world % 2 == 0:
        specs = [dataclasses.replace(s, layout=HybridShard(2)) if i % 3 == 0 else s for i, s in enumerate(specs)]
    plan = make_write_plan(specs, src_world, chunk)
    source = PlanPieces(plan, "run.1")
    dst_rank %= dst_world
    fast, listed = [], []
    for i, s in enumerate(plan.specs):
        layout = [Shard(0), BlockShard(3), Replicate(), Owned((i + 1) % dst_world)][i % 4]
        rng = layout.flat_range(s.shape, dst_world, dst_rank)
        if not len(rng):
            continue
        saved = _saved_tensor(s, source)
        want = rng if i % 2 else Part(whole(s.shape), rng.start, rng.stop)  # either form of a flat want
        if i % 5 == 4 and len(s.shape) == 2 and min(s.shape) > 1:  # a box: all but the first row and column
            want = box_part(Box((1, 1), (s.shape[0] - 1, s.shape[1] - 1)))
        fast.append((saved, want))
        listed.append((dataclasses.replace(saved, pieces=tuple(saved.all_pieces())), want))

    def rows(by_file):
        return {f: list(zip(*(c.tolist() for c in cols))) for f, cols in by_file.items() if len(cols[0])}

    got = rows(gather_runs(fast))
    assert got == rows(gather_runs(listed))
    assert sum(n for r in got.values() for _, n, _, _ in r) == sum(
        len(w) * s.dtype.itemsize for s, w in fast)


def test_a_version_2_flat_want_the_pieces_do_not_cover_is_refused_naming_the_tensor():
    from flexckpt.format.manifest import PlanPieces
    from flexckpt.format.manifest_parse import _saved_tensor
    from flexckpt.format.write_plan import make_write_plan

    plan = make_write_plan([TensorSpec("w", torch.float32, (10, 4), Shard(0))], 2, 64)
    saved = _saved_tensor(plan.specs[0], PlanPieces(plan, "run.1"))
    with pytest.raises(ManifestError, match=r"tensor 'w': the checkpoint's pieces hold 40 of the 41 elements wanted"):
        gather_runs([(saved, FlatRange(0, 41))])
