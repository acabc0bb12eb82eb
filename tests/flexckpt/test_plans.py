"""Write plans, read plans and manifest validation: pure functions, no processes, no files."""
import dataclasses
import math

import orjson
import pytest
import torch
from hypothesis import given, settings, strategies as st

from flexckpt.errors import ManifestError
from flexckpt.format.checksum import checksum
from flexckpt.format.jsondoc import unseal
from manifest_edit import set_at
from flexckpt.format.manifest_parse import parse_manifest
from flexckpt.format.write_plan import ALIGN, make_write_plan
from flexckpt.load.read_plan import gather_runs
from flexckpt.state.structure import TensorSpec
from flexshard import BlockShard, FlatRange, Owned, Replicate, Shard
from manifest_v1_writer import random_specs, save_in_memory, shapes_st, v1_manifest_bytes
from read_plan_reference import coalesce, file_reads, plan_reads


@settings(max_examples=150, deadline=None)
@given(shapes=shapes_st, world=st.integers(1, 6), chunk=st.sampled_from([64, 128, 200, 4096]))
def test_write_plan_writes_every_element_exactly_once_and_tiles_each_stream(shapes, world, chunk):
    specs = random_specs(shapes, world)
    plan = make_write_plan(specs, world, chunk)
    written = {s.name: [] for s in plan.specs}
    for rp in plan.ranks:
        end = 0
        for p in rp.pieces:
            spec = plan.specs[p.spec_index]
            assert p.offset % ALIGN == 0 and p.offset >= end
            assert p.nbytes == (p.stop - p.start) * spec.dtype.itemsize
            end = p.offset + p.nbytes
            written[spec.name].append((p.start, p.stop))
        assert rp.nbytes >= end and rp.nbytes % ALIGN == 0
        pos = 0
        for c in rp.chunks:  # chunks tile [0, nbytes) exactly
            assert c.offset == pos and 0 < c.length <= chunk
            pos += c.length
        assert pos == rp.nbytes
        for p in rp.pieces:  # a piece of at least one chunk starts a chunk of its own
            if p.nbytes >= chunk:
                assert p.offset in {c.offset for c in rp.chunks}
    for spec in plan.specs:
        ranges = sorted(written[spec.name])
        pos = 0
        for a, b in ranges:
            assert a == pos
            pos = b
        assert pos == spec.numel


def test_chunks_are_about_a_sixteenth_of_a_piece_between_64_kib_and_the_limit():
    mib = 1 << 20
    specs = [
        TensorSpec("big", torch.uint8, (64 * mib,), Replicate()),
        TensorSpec("mid", torch.uint8, (mib,), Replicate()),
        TensorSpec("small0", torch.uint8, (40_000,), Replicate()),
        TensorSpec("small1", torch.uint8, (40_000,), Replicate()),
    ]
    plan = make_write_plan(specs, 1, 2 * mib)
    by_name = {plan.specs[p.spec_index].name: p for p in plan.ranks[0].pieces}
    sizes = lambda p: [c.length for c in plan.ranks[0].chunks if p.offset <= c.offset < p.offset + p.nbytes]  # noqa: E731
    assert sizes(by_name["big"]) == [2 * mib] * 32  # 1/16 would be 4 MiB: capped
    assert sizes(by_name["mid"]) == [64 << 10] * 16  # exactly 1/16
    # the two small pieces share chunks of at most 64 KiB
    assert all(c.length <= 64 << 10 for c in plan.ranks[0].chunks if c.offset >= by_name["small0"].offset)


def test_replicated_tensors_are_spread_over_ranks_largest_first():
    specs = [TensorSpec(f"r{i}", torch.float32, (100 * (i + 1),), Replicate()) for i in range(8)]
    plan = make_write_plan(specs, 4, 4096)
    writers = {plan.specs[p.spec_index].name: r for r, rp in enumerate(plan.ranks) for p in rp.pieces}
    assert writers == {"r7": 0, "r6": 1, "r5": 2, "r4": 3, "r3": 3, "r2": 2, "r1": 1, "r0": 0}
    loads = [sum(p.nbytes for p in rp.pieces) for rp in plan.ranks]
    assert max(loads) - min(loads) <= 400 * 4


def test_plan_does_not_depend_on_the_order_tensors_were_found_in():
    specs = random_specs([(10, 3), (7,), (), (33, 2), (5,)], 3)
    a, b = make_write_plan(specs, 3, 128), make_write_plan(list(reversed(specs)), 3, 128)
    assert a.specs == b.specs and list(a.ranks) == list(b.ranks)


def test_duplicate_names_are_refused():
    spec = TensorSpec("x", torch.float32, (2,), Replicate())
    with pytest.raises(ValueError, match="duplicate"):
        make_write_plan([spec, spec], 1, 4096)


# -- read plans against a simulated store (a version-1 checkpoint in memory) --------------------
@settings(max_examples=100, deadline=None)
@given(shapes=shapes_st, src_world=st.integers(1, 5), dst_world=st.integers(1, 5), chunk=st.sampled_from([64, 256, 4096]))
def test_read_plan_rebuilds_every_target_piece_at_another_world_size(shapes, src_world, dst_world, chunk):
    specs = random_specs(shapes, src_world)
    gen = torch.Generator().manual_seed(len(shapes))
    globals_ = {
        s.name: (torch.randint(0, 100, s.shape, generator=gen) if s.dtype != torch.bool else torch.rand(s.shape, generator=gen) > 0.5).to(s.dtype)
        for s in specs
    }
    manifest, streams = save_in_memory(globals_, specs, src_world, chunk)
    # round trip through JSON validation too
    manifest = parse_manifest(v1_manifest_bytes(manifest))
    for dst_rank in range(dst_world):
        targets = []
        for i, s in enumerate(sorted(specs, key=lambda s: s.name)):
            layout = [Shard(0), BlockShard(3), Replicate(), Owned((i + 1) % dst_world)][i % 4]
            targets.append((manifest.tensors[s.name], layout.flat_range(s.shape, dst_world, dst_rank)))
        out = [bytearray(len(rng) * t.dtype.itemsize) for t, rng in targets]
        for cr in plan_reads(manifest, [(t, rng) for t, rng in targets if len(rng)]):
            data = streams[cr.file][cr.chunk.raw_offset : cr.chunk.raw_offset + cr.chunk.raw_length]
            assert checksum(bytes(data)) == cr.chunk.checksum
            nonempty = [k for k, (t, rng) in enumerate(targets) if len(rng)]
            for cp in cr.copies:
                out[nonempty[cp.target]][cp.target_pos : cp.target_pos + cp.nbytes] = data[cp.chunk_pos : cp.chunk_pos + cp.nbytes]
        for (t, rng), got in zip(targets, out):
            want = globals_[t.name].reshape(-1)[rng.start : rng.stop].contiguous().view(torch.uint8).numpy().tobytes()
            assert bytes(got) == want, t.name


def test_a_chunk_that_lands_whole_in_one_target_is_read_straight_into_it():
    specs = [TensorSpec("big", torch.float32, (4096,), Shard(0))]
    manifest, _ = save_in_memory({"big": torch.arange(4096.0)}, specs, 2, 1024)
    reads = plan_reads(manifest, [(manifest.tensors["big"], FlatRange(0, 4096))])
    assert len(reads) == 16 and all(r.whole for r in reads)
    # a target cut in the middle of a chunk: that chunk needs a scratch copy
    reads = plan_reads(manifest, [(manifest.tensors["big"], FlatRange(100, 4096))])
    assert [r.whole for r in reads].count(False) == 1


# -- manifest validation ----------------------------------------------------------------------
def _good_manifest_doc():
    specs = [TensorSpec("w", torch.float32, (8, 2), Shard(0))]
    manifest, _ = save_in_memory({"w": torch.ones(8, 2)}, specs, 2, 64)
    return orjson.loads(unseal(v1_manifest_bytes(manifest))[0])  # the document without its checksum: edited below


def test_a_valid_manifest_round_trips():
    doc = _good_manifest_doc()
    m = parse_manifest(orjson.dumps(doc))
    assert m.tensors["w"].shape == (8, 2) and m.tensors["w"].layout == Shard(0)
    assert orjson.loads(unseal(v1_manifest_bytes(m))[0]) == doc


def _mutations():
    file0 = "r0"
    return {
        "path traversal in a file name": lambda d: d["files"].__setitem__("../../etc/passwd", d["files"].pop(file0)),
        "slash in a file name": lambda d: d["files"].__setitem__("a/b", d["files"].pop(file0)),
        "piece names an unknown file": set_at(["tensors", "w", "pieces", 0, 0], "nope"),
        "negative offset": set_at(["tensors", "w", "pieces", 0, 3], -1),
        "piece past the end of its file": set_at(["tensors", "w", "pieces", 0, 3], 10**6),
        "stop beyond numel": set_at(["tensors", "w", "pieces", 0, 2], 17),
        "unknown dtype": set_at(["tensors", "w", "dtype"], "float128"),
        "negative dimension": set_at(["tensors", "w", "shape"], [-8, 2]),
        "absurd shape": set_at(["tensors", "w", "shape"], [2**40, 2**40]),
        "bool as int": set_at(["step"], True),
        "wrong version": set_at(["version"], 99),
        "wrong checksum algorithm": set_at(["checksum"], "crc32"),
        "checksum not hex": set_at(["files", file0, "chunks", 0, 5], "zz" * 8),
        "gap between chunks": set_at(["files", file0, "chunks", 0, 0], 64),
        "unknown codec": set_at(["files", file0, "chunks", 0, 4], "lz4"),
        "uncompressed chunk with a different stored length": set_at(["files", file0, "chunks", 0, 3], 1),
        "file size not covered by chunks": set_at(["files", file0, "nbytes"], 10**6),
        "unknown layout": set_at(["tensors", "w", "layout"], {"kind": "cyclic"}),
        "run id with a slash": set_at(["run_id"], "../x"),
        "per-rank list of the wrong length": set_at(["per_rank"], {"rng": [1]}),
    }


@pytest.mark.parametrize("what", sorted(_mutations()))
def test_manifest_validation_rejects(what):
    doc = _good_manifest_doc()
    _mutations()[what](doc)
    with pytest.raises(ManifestError):
        parse_manifest(orjson.dumps(doc))


@pytest.mark.parametrize("data", [b"", b"[]", b"{", b'{"format": "flexckpt"}', b"\xff\xfe"])
def test_garbage_is_not_a_manifest(data):
    with pytest.raises(ManifestError):
        parse_manifest(data)


def test_numel_overflow_is_checked_before_any_allocation():
    doc = _good_manifest_doc()
    doc["tensors"]["w"]["shape"] = [2**30, 2**30]
    with pytest.raises(ManifestError, match="elements"):
        parse_manifest(orjson.dumps(doc))
    assert math.prod([2**30, 2**30]) > 2**48


def test_adjacent_chunks_are_fetched_together_up_to_a_limit():
    specs = [TensorSpec("a", torch.float32, (1024,), Replicate()), TensorSpec("b", torch.float32, (10,), Replicate()),
             TensorSpec("c", torch.float32, (1024,), Replicate())]
    manifest, _ = save_in_memory({"a": torch.ones(1024), "b": torch.ones(10), "c": torch.ones(1024)}, specs, 1, 1024)
    full = [(manifest.tensors[n], FlatRange(0, manifest.tensors[n].numel)) for n in "abc"]
    reads = plan_reads(manifest, full)
    fetches = coalesce(reads, 1 << 20)
    assert [len(f.reads) for f in fetches] == [9]  # a: 4 chunks, b: 1 shared chunk, c: 4 chunks
    assert sum(f.length for f in fetches) == manifest.files["r0"].nbytes
    assert [len(f.reads) for f in coalesce(reads, 2048)] == [2, 2, 2, 2, 1]


def test_the_runs_a_load_wants_are_gathered_per_file_before_any_chunk_table():
    # Shard(0) of 4096 floats saved at world 2: elements 1000..2999 are the end of rank 0's
    # piece and the start of rank 1's, one run in each file
    specs = [TensorSpec("big", torch.float32, (4096,), Shard(0))]
    manifest, _ = save_in_memory({"big": torch.arange(4096.0)}, specs, 2, 1024)
    want = [(manifest.tensors["big"], FlatRange(1000, 3000))]
    runs = gather_runs(want)
    assert {f: [c.tolist() for c in cols] for f, cols in runs.items()} == {
        "r0": [[4000], [4192], [0], [0]],     # raw byte start, length, target, byte position in the target
        "r1": [[0], [3808], [0], [4192]],
    }
    # cut at the chunks' bounds file by file, they are the whole read plan
    assert [cr for f in sorted(runs) for cr in file_reads(f, manifest.files[f], runs[f])] == plan_reads(manifest, want)
    with pytest.raises(ManifestError, match="hold 2048 of the 4096 elements"):
        half = dataclasses.replace(manifest.tensors["big"], pieces=manifest.tensors["big"].pieces[:1])
        gather_runs([(half, FlatRange(0, 4096))])
