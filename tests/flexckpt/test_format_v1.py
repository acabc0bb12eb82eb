"""The on-disk format: version-1 checkpoints (made by the flexckpt of c0aceba, kept under
tests/data/v1) still load, at the saved world size and another."""
import shutil

import pytest
import torch

from flexckpt import ByLane, Checkpointer, PerRank, SaveError
from flexshard import BlockShard, ShardedTensor
from v1_fixture import DATA, fixture


def _empty_state(rank, world, layouts):
    g = fixture.global_tensors()
    return {
        "t": {n: ShardedTensor.empty(v.shape, layouts[n], dtype=v.dtype, rank=rank, world_size=world) for n, v in g.items()},
        "step": 0,
        "lanes": ByLane(),
        "rng": PerRank(None),
    }


@pytest.mark.parametrize("sub", ["plain", "zstd"])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_version_1_checkpoint_loads_at_any_world_size(tmp_path, sub, world):
    root = tmp_path / "ck"
    shutil.copytree(DATA / "v1" / sub, root)
    layouts = dict(fixture.LAYOUTS, owned=BlockShard(2))  # load into other layouts too
    want = fixture.global_tensors()
    for rank in range(world):
        state = _empty_state(rank, world, layouts)
        cp = Checkpointer(str(root), rank=rank, world_size=world, run_id="reader")
        assert cp.steps() == [3]
        assert cp.load(state, exclude=() if world == 2 else ("rng",)) == 3  # per-rank: same world only
        for name, st in state["t"].items():
            expect = ShardedTensor.from_global(want[name], layouts[name], rank, world).local
            assert torch.equal(st.local, expect), name
        assert state["step"] == 3
        assert state["lanes"].values == {"0": {"doc": 10}, "1": {"doc": 11}}
        assert state["rng"].restored == (world == 2)
        if world == 2:
            assert state["rng"].value == {"seed": 100 + rank}
        cp.close()


# -- version 2 --------------------------------------------------------------------------------
import math  # noqa: E402
import threading  # noqa: E402

import orjson  # noqa: E402
from hypothesis import given, settings, strategies as st  # noqa: E402

from flexckpt import ManifestError  # noqa: E402
from flexckpt.cli import main as cli_main  # noqa: E402
from flexckpt.format.names import GROUP, MANIFEST, group_name, record_name, step_dir  # noqa: E402
from flexckpt.format.write_plan import PlanRules, WritePlan, make_write_plan, sharded_loads  # noqa: E402
from flexckpt.save.commit import build_manifest, gather, lead_group, mark_failed, record_doc  # noqa: E402
from flexckpt.state.structure import TensorSpec  # noqa: E402
from flexckpt.storage import Storage  # noqa: E402
from flexshard import FlatRange, HybridShard, Owned, Replicate, Shard  # noqa: E402

V2_TENSORS = {
    "a": ((97, 5), torch.float32), "b": ((33,), torch.bfloat16), "c": ((), torch.float64), "d": ((64, 3), torch.int64),
    "e": ((0, 3), torch.float32), "f": ((200, 2), torch.float16), "g": ((9,), torch.bool),
}


def _v2_global(name):
    shape, dtype = V2_TENSORS[name]
    g = torch.Generator().manual_seed(len(name) * 7 + ord(name))
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    return (torch.randn(shape, generator=g) * 50).to(dtype)


def _v2_layouts(world, shift):
    group = 2 if world % 2 == 0 else 1
    kinds = [Replicate(), Shard(0), Owned(world - 1), BlockShard(4), HybridShard(group), HybridShard(group, 8)]
    return {n: kinds[(i + shift) % len(kinds)] for i, n in enumerate(V2_TENSORS)}


def _v2_state(rank, world, layouts, empty=False):
    out = {}
    for n, (shape, dtype) in V2_TENSORS.items():
        out[n] = (ShardedTensor.empty(shape, layouts[n], dtype=dtype, rank=rank, world_size=world) if empty
                  else ShardedTensor.from_global(_v2_global(n), layouts[n], rank, world))
    out["lanes"] = ByLane({} if empty else {f"{rank}": {"doc": rank}})
    out["rng"] = PerRank(None if empty else {"rank": rank, "pad": "x" * 100})
    return out


@pytest.mark.parametrize("compression", [None, "zstd"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_version_2_round_trips_every_layout_at_the_same_and_another_world(tmp_path, world, compression):
    saved = _v2_layouts(world, world)
    cps = [Checkpointer(str(tmp_path), rank=r, world_size=world, run_id="v2", compression=compression, chunk_bytes=128,
                        fsync=False) for r in range(world)]
    hs = [cp.save(4, _v2_state(r, world, saved)) for r, cp in enumerate(cps)]
    assert [h.result(timeout=30) for h in hs] == [4] * world
    for cp in cps:
        cp.close()
    doc = orjson.loads((tmp_path / step_dir(4) / MANIFEST).read_bytes())
    assert doc["version"] == 4 and doc["codec"] == (compression or "none") and len(doc["ranks"]) == world
    assert all(set(t) == {"dtype", "shape", "layout"} for t in doc["tensors"].values())  # no pieces, no chunks
    assert doc["per_rank"] == ["rng"] and b"pad" not in (tmp_path / step_dir(4) / MANIFEST).read_bytes()
    # per-rank values: in a file of the rank's own, not in the manifest or the chunk tables others read
    folder = tmp_path / step_dir(4) / doc["attempt"]
    assert all(b"pad" not in (folder / f"r{r:05d}.table").read_bytes() for r in range(world))
    assert b"pad" in (folder / f"r{world - 1:05d}.values").read_bytes()
    for load_world in sorted({world, world % 4 + 1}):
        layouts = _v2_layouts(load_world, world + 1)
        for r in range(load_world):
            target = _v2_state(r, load_world, layouts, empty=True)
            with Checkpointer(str(tmp_path), rank=r, world_size=load_world, run_id="rd") as ck:
                assert ck.load(target, exclude=() if load_world == world else ("rng",)) == 4
            for n in V2_TENSORS:
                want = ShardedTensor.from_global(_v2_global(n), layouts[n], r, load_world).local
                assert torch.equal(target[n].local, want), (n, layouts[n], r, load_world)
            assert target["lanes"].values == {str(q): {"doc": q} for q in range(world)}
            assert target["rng"].restored == (load_world == world)
            if load_world == world:
                assert target["rng"].value == {"rank": r, "pad": "x" * 100}


def test_a_flipped_byte_in_a_chunk_table_is_detected(tmp_path, capsys):
    cps = [Checkpointer(str(tmp_path), rank=r, world_size=2, run_id="v2", chunk_bytes=128, fsync=False) for r in range(2)]
    layouts = _v2_layouts(2, 0)
    assert [h.result(30) for h in [cp.save(1, _v2_state(r, 2, layouts)) for r, cp in enumerate(cps)]] == [1, 1]
    for cp in cps:
        cp.close()
    attempt = orjson.loads((tmp_path / step_dir(1) / MANIFEST).read_bytes())["attempt"]
    table = tmp_path / step_dir(1) / attempt / "r00001.table"
    raw = bytearray(table.read_bytes())
    raw[len(raw) // 2] ^= 0x04
    table.write_bytes(bytes(raw))
    target = _v2_state(1, 2, layouts, empty=True)
    with Checkpointer(str(tmp_path), rank=1, world_size=2, run_id="rd") as ck:
        with pytest.raises(ManifestError, match=r"chunk table .*r00001.table.*damaged"):
            ck.load(target)
    assert cli_main(["verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "DAMAGED" in out and "chunk table of rank 1" in out


def _spec_set(world):
    group = max(g for g in (1, 2, 3, 4) if world % g == 0)
    return [
        TensorSpec("a", torch.float32, (97, 5), Shard(0)), TensorSpec("b", torch.float32, (70,), BlockShard(4)),
        TensorSpec("c", torch.float32, (33, 2), HybridShard(group)), TensorSpec("d", torch.bfloat16, (50,), HybridShard(group, 3)),
        TensorSpec("e", torch.float32, (5, 5), Owned(world - 1)), TensorSpec("f", torch.float32, (7,), Replicate()),
        TensorSpec("g", torch.int64, (3,), Replicate()), TensorSpec("h", torch.float32, (0, 4), Shard(0)),
    ]


@settings(max_examples=200, deadline=None, derandomize=True)
@given(world=st.integers(1, 9), start=st.integers(0, 400), length=st.integers(0, 400), part=st.sampled_from([64, 128, 1 << 20]))
def test_writers_in_closed_form_match_every_ranks_own_plan(world, start, length, part):
    plan = WritePlan(_spec_set(world), world, PlanRules(128, hybrid_part_bytes=part))
    for i, spec in enumerate(plan.specs):
        written = sorted((FlatRange(p.start, p.stop), r) for r in range(world) for p in plan.rank_plan(r).pieces
                         if p.spec_index == i)
        pos = 0
        for piece, _ in written:  # every element written once
            assert piece.start == pos
            pos = piece.stop
        assert pos == spec.numel
        rng = FlatRange(min(start, spec.numel), min(start + length, spec.numel))
        brute = [(p, r) for p, r in written if p.intersect(rng)]
        assert sorted((FlatRange(p.start, p.stop), r) for r, p in plan.writers(i, rng)) == brute, spec
    loads = sharded_loads(plan.specs, world, plan.rules).tolist()
    want = [sum(p.nbytes for p in plan.rank_plan(r).pieces if not isinstance(plan.specs[p.spec_index].layout, Replicate))
            for r in range(world)]
    assert loads == want


@settings(max_examples=150, deadline=None, derandomize=True)
@given(world=st.integers(1, 9), start=st.integers(0, 400), length=st.integers(0, 400), part=st.sampled_from([64, 1 << 20]),
       box=st.tuples(st.integers(0, 96), st.integers(1, 40), st.integers(0, 4), st.integers(1, 5)))
def test_pieces_in_are_the_pieces_each_rank_wrote_that_hold_the_wanted_elements(world, start, length, part, box):
    """A load's pieces (file, elements, offset), recomputed per wanted range or box, against
    every rank's own plan: a flat range, the same range as a part of the whole tensor, and
    a box (of a flat layout: the pieces holding the flat span from its first element to
    its last)."""
    from flexckpt.format.manifest import PlanPieces, SavedPiece
    from flexckpt.format.manifest_parse import _saved_tensor
    from flexckpt.format.manifest import SavedTensor
    from flexckpt.format.names import data_name
    from flexshard import Box, Part
    from flexshard.box import whole

    attempt = "job.01234567.1"
    plan = WritePlan(_spec_set(world), world, PlanRules(128, hybrid_part_bytes=part))
    source = PlanPieces(plan, attempt)
    for i, spec in enumerate(plan.specs):
        saved = _saved_tensor(spec, source)
        assert saved == SavedTensor(spec.name, spec.dtype, spec.shape, spec.layout, None, source) and saved.source is source
        written = [SavedPiece(data_name(attempt, r), p.start, p.stop, p.offset, p.box)
                   for r in range(world) for p in plan.rank_plan(r).pieces if p.spec_index == i]

        def brute(lo, hi):
            return sorted(p for p in written if lo < hi and p.start < hi and lo < p.stop)

        rng = FlatRange(min(start, spec.numel), min(start + length, spec.numel))
        assert sorted(saved.pieces_in(rng)) == brute(*rng), spec
        assert sorted(saved.pieces_in(Part(whole(spec.shape), *rng))) == brute(*rng), spec
        if len(spec.shape) == 2 and spec.numel:
            rows, cols = spec.shape
            r0, c0 = min(box[0], rows - 1), min(box[2], cols - 1)
            b = Box((r0, c0), (min(box[1], rows - r0), min(box[3], cols - c0)))
            first, last = r0 * cols + c0, (r0 + b.sizes[0] - 1) * cols + c0 + b.sizes[1] - 1
            assert sorted(saved.pieces_in(Part(b, 0, b.numel))) == brute(first, last + 1), (spec, b)
        assert sorted(saved.all_pieces()) == brute(0, spec.numel)


def test_hybrid_shard_writing_is_spread_over_the_replicas():
    # 8 tensors of 4096 x 64 fp32 in groups of 4 over 32 ranks: each position's piece is
    # 256 KiB, written in 4 parts of 64 KiB by 4 of its 8 replicas, going round
    specs = [TensorSpec(f"t{i}", torch.float32, (4096, 64), HybridShard(4)) for i in range(8)]
    plan = WritePlan(specs, 32, PlanRules(1 << 20, hybrid_part_bytes=64 << 10))
    loads = [plan.rank_plan(r).nbytes for r in range(32)]
    assert sum(loads) == 8 * 4096 * 64 * 4
    assert max(loads) == min(loads) == sum(loads) // 32  # perfectly even here


def test_manifest_grows_with_tensors_plus_ranks_not_their_product():
    specs = [TensorSpec(f"layer{i:03d}", torch.float32, (4096, 256), BlockShard(32)) for i in range(200)]
    sizes = {}
    for world in (64, 4096):
        plan = make_write_plan(specs, world, 2 << 20)
        entries = {r: ["f" * 32, "0123456789abcdef", 200, 1 << 30, "0123456789abcdef", 5000] for r in range(world)}
        m = build_manifest(step=1, run_id="job", attempt="job.01234567.1", plan=plan, fingerprint="f" * 32,
                           codec="none", entries=entries, plain={}, lanes={}, per_rank_keys=[])
        sizes[world] = len(m.to_bytes())
    per_rank = (sizes[4096] - sizes[64]) / (4096 - 64)
    assert per_rank < 80  # bytes per added rank (goal: at most 1 kB)
    assert sizes[64] < 40_000  # 200 tensors: about 130 bytes each


def test_group_leaders_gather_records_so_rank_0_reads_one_per_group(tmp_path):
    world, step, attempt = 2 * GROUP + 3, 7, "job.01234567.1"
    storage = Storage(str(tmp_path))

    def own(r):
        return record_doc(run_id="job", attempt=attempt, step=step, world_size=world,
                          entries={r: ["fp", f"{r:016x}", 100 + r, r, "", 0]}, lanes={"data": {str(r): r}})

    for r in range(world):
        if r % GROUP:
            rel = f"{step_dir(step)}/{record_name(attempt, r)}"
            storage.makedirs(rel.rsplit("/", 1)[0])
            storage.put_atomic(rel, own(r), fsync=False)
    reads = []
    real = Storage.read_bytes

    def counting(self, rel, limit=None):
        reads.append(rel)
        return real(self, rel, limit)

    Storage.read_bytes = counting
    try:
        def lead(g):
            out = lead_group(storage, step=step, run_id="job", attempt=attempt, world_size=world, rank=g * GROUP,
                             own=own(g * GROUP), timeout=30, max_delay=0.01)
            rel = f"{step_dir(step)}/{group_name(attempt, g)}"
            storage.makedirs(rel.rsplit("/", 1)[0])
            storage.put_atomic(rel, out, fsync=False)

        leaders = [threading.Thread(target=lead, args=(g,)) for g in (1, 2)]
        for t in leaders:
            t.start()
        for t in leaders:
            t.join(30)
        reads.clear()
        entries, lanes = gather(storage, step=step, run_id="job", attempt=attempt, world_size=world, own=own(0),
                                timeout=30, max_delay=0.01)
    finally:
        Storage.read_bytes = real
    assert sorted(entries) == list(range(world)) and entries[5] == ["fp", f"{5:016x}", 105, 5, "", 0]
    assert lanes == {"data": {str(r): r for r in range(world)}}
    assert len(reads) == (GROUP - 1) + 2  # its own group's records and one record per other group
    # a failure marker of the attempt ends a wait at once
    mark_failed(storage, 8, attempt, "rank 9 failed while writing: disk full")
    with pytest.raises(SaveError, match="rank 9 failed"):
        lead_group(storage, step=8, run_id="job", attempt=attempt, world_size=world, rank=0, own=own(0),
                   timeout=30, max_delay=0.01)


def test_hybrid_shard_parts_round_trip_when_pieces_are_cut_small(tmp_path, monkeypatch):
    import flexckpt.save.pipeline as ckmod

    monkeypatch.setattr(ckmod, "make_write_plan", lambda specs, w, c: WritePlan(specs, w, PlanRules(c, hybrid_part_bytes=64)))
    world = 4
    saved = {n: HybridShard(2, 8 if i % 2 else None) for i, n in enumerate(V2_TENSORS)}
    cps = [Checkpointer(str(tmp_path), rank=r, world_size=world, run_id="v2", chunk_bytes=128, fsync=False) for r in range(world)]
    assert [h.result(30) for h in [cp.save(2, _v2_state(r, world, saved)) for r, cp in enumerate(cps)]] == [2] * world
    for cp in cps:
        cp.close()
    rules = orjson.loads((tmp_path / step_dir(2) / MANIFEST).read_bytes())["rules"]
    assert rules["hybrid_part_bytes"] == 64
    layouts = _v2_layouts(3, 1)
    for r in range(3):
        target = _v2_state(r, 3, layouts, empty=True)
        with Checkpointer(str(tmp_path), rank=r, world_size=3, run_id="rd") as ck:
            ck.load(target, exclude=("rng",))
        for n in V2_TENSORS:
            assert torch.equal(target[n].local, ShardedTensor.from_global(_v2_global(n), layouts[n], r, 3).local), n
