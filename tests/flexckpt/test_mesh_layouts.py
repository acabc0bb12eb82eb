"""Tensor-parallel and 2-D/3-D DTensor placements: pieces that are n-D boxes.

Pure checks first (a rank's box against torch's own ``_compute_local_shape_and_global_offset``,
the run intersection against brute force, the read bound), then the reshard matrix and a
property test with DTensors built on torch's fake process-group backend: every rank of a
world is played in this one process (``init_process_group("fake")`` per rank, the DTensor
built with ``from_local(run_check=False)``, the group destroyed before the checkpointer
runs, so nothing communicates), saved under one mesh and placements, loaded under another,
compared bit for bit."""
from __future__ import annotations

import itertools
import math
import random
import uuid

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from flexckpt import Checkpointer
from flexckpt.format.write_plan import PlanRules, WritePlan, sharded_loads
from flexckpt.state.structure import TensorSpec
from flexshard import Box, MeshLayout, Part, Shard, ShardedTensor, flat_part, part_of, runs
from flexshard.box import box_part

from torch.distributed.tensor import DTensor, Partial
from torch.distributed.tensor import Shard as DShard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset as torch_piece
from torch.testing._internal.distributed.fake_pg import FakeStore
from mesh_states import _bits_equal, _global, _torch_placement, dtensor_on


# -- pure: the box of a rank ------------------------------------------------------------------
def _random_placements(rng: random.Random, ndim: int, mesh: tuple) -> tuple:
    out = []
    for _ in mesh:
        kind, d = rng.choice(["R", "S", "S", "SS"]), rng.randrange(ndim)
        out.append("R" if kind == "R" else f"S{d}" if kind == "S" else f"SS{d}:{rng.randint(1, 3)}")
    return tuple(out)


def _random_mesh(rng: random.Random, most: int) -> tuple:
    while True:
        mesh = tuple(rng.randint(1, 3) for _ in range(rng.randint(1, 3)))
        if math.prod(mesh) <= most:
            return mesh


@settings(max_examples=300, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**32 - 1))
def test_a_ranks_box_is_what_torch_computes_for_its_coordinate(seed):
    rng = random.Random(seed)  # uniform cases (hypothesis' own draws shrink towards tiny ones)
    shape = tuple(rng.randint(0, 11) for _ in range(rng.randint(1, 3)))
    mesh = _random_mesh(rng, 27)
    codes = _random_placements(rng, len(shape), mesh)
    layout = MeshLayout(tuple(mesh), tuple(codes))
    for rank in range(layout.size):
        coord = layout.coordinate(rank)
        try:
            box = layout.box(shape, layout.size, rank)
        except ValueError as e:  # a strided set: torch's piece is not one box either
            assert "strided set" in str(e)
            continue
        sizes, offsets = torch_piece(tuple(shape), tuple(mesh), list(coord), [_torch_placement(c) for c in codes])
        assert box.sizes == tuple(sizes)
        if box.numel:
            assert box.offsets == tuple(offsets)


def test_torchtitan_fsdp_tp_placements_give_every_rank_one_box_uneven_rows_included():
    # (_StridedShard(0, 2), Shard(0)) on (fsdp 2, tp 2): tp splits first, fsdp within
    layout = MeshLayout((2, 2), ("SS0:2", "S0"))
    boxes = [layout.box((10, 3), 4, r) for r in range(4)]
    assert boxes == [Box((0, 0), (3, 3)), Box((5, 0), (3, 3)), Box((3, 0), (2, 3)), Box((8, 0), (2, 3))]
    rowwise = MeshLayout((2, 2), ("S0", "S1"))
    assert [rowwise.box((5, 3), 4, r) for r in range(4)] == [
        Box((0, 0), (3, 2)), Box((0, 2), (3, 1)), Box((3, 0), (2, 2)), Box((3, 2), (2, 1))]


def test_a_lone_strided_shard_and_partial_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="strided set of indices along dim 0.*redistribute"):
        MeshLayout((2,), ("SS0:2",)).box((8, 6), 2, 0)
    from flexckpt.state.dtensor import _code
    with pytest.raises(ValueError, match="redistribute it first"):
        _code(Partial())
    with pytest.raises(ValueError, match="placement 'X0' is not R, S<dim> or SS<dim>:<split_factor>"):
        MeshLayout((2,), ("X0",))


def test_the_mesh_rank_table_decides_a_ranks_position():
    layout = MeshLayout((2, 2), ("S0", "S1"), (1, 0, 3, 2))
    assert layout.coordinate(0) == (0, 1) and layout.rank_at((0, 1)) == 0
    assert layout.box((4, 4), 4, 0) == Box((0, 2), (2, 2))
    assert MeshLayout((2, 2), ("S0", "S1"), (0, 1, 2, 3)).ranks is None  # the identity is not stored
    with pytest.raises(ValueError, match="4 distinct ranks"):
        MeshLayout((2, 2), ("S0", "S1"), (0, 0, 1, 2))


# -- pure: the runs two parts share -----------------------------------------------------------
def _elements(part: Part, shape) -> list[int]:
    """Global flat indices of a part, in its stored order (brute force)."""
    idx = torch.arange(math.prod(shape)).view(shape)
    b = part.box
    sub = idx[tuple(slice(o, o + n) for o, n in zip(b.offsets, b.sizes))].reshape(-1)
    return sub[part.start : part.stop].tolist()


@settings(max_examples=300, deadline=None, derandomize=True)
@given(shape=st.lists(st.integers(1, 6), min_size=0, max_size=3), seed=st.integers(0, 2**32 - 1))
def test_runs_are_exactly_the_shared_elements_contiguous_on_both_sides(shape, seed):
    shape = tuple(shape)
    rng = random.Random(seed)  # uniform boxes and stretches (hypothesis' draws shrink towards empty ones)

    def part():
        offs = [rng.randrange(n) for n in shape]
        box = Box(tuple(offs), tuple(rng.randint(1, n - o) for o, n in zip(offs, shape)))
        start, stop = sorted(rng.randint(0, box.numel) for _ in range(2))
        return Part(box, start, stop) if rng.random() < 0.8 else box_part(box)

    src, dst = part(), part()
    got = runs(src, dst)
    s_el, d_el = _elements(src, shape), _elements(dst, shape)
    pairs = sorted((s_el[s + k], s + k, d + k) for s, d, n in got.tolist() for k in range(n))
    want = sorted((g, s_el.index(g), d_el.index(g)) for g in set(s_el) & set(d_el))
    assert pairs == want


def test_a_flat_range_against_a_flat_range_is_one_run():
    assert runs(flat_part((8, 4), 4, 20), flat_part((8, 4), 10, 32)).tolist() == [[6, 0, 10]]
    # a dim-0 slab of a box into a whole tensor: one run a row of the box
    assert runs(box_part(Box((2, 0), (2, 2))), flat_part((4, 4), 0, 16)).tolist() == [[0, 8, 2], [2, 12, 2]]


# -- the write plan: every element written once, by a rank that holds it -----------------------
@pytest.mark.parametrize("mesh,codes", [((2, 2), ("SS0:2", "S0")), ((2, 2), ("S0", "S1")), ((2, 2, 2), ("R", "SS0:2", "S0")),
                                        ((2, 2, 2), ("R", "S0", "R")), ((4,), ("S1",)), ((3, 2), ("S1", "S0"))])
def test_mesh_tensors_are_written_once_spread_over_replicas(mesh, codes):
    world = math.prod(mesh)
    layout = MeshLayout(mesh, codes)
    specs = [TensorSpec(f"t{i}", torch.float32, (11, 6), layout) for i in range(4)]
    plan = WritePlan(specs, world, PlanRules(256))
    for i, spec in enumerate(plan.specs):
        seen = torch.zeros(spec.shape, dtype=torch.int64)
        for r in range(world):
            for p in plan.rank_plan(r).pieces:
                if p.spec_index == i:
                    assert p.box == layout.box(spec.shape, world, r) or p.box is None  # its own box, whole
                    b = layout.box(spec.shape, world, r)
                    seen[tuple(slice(o, o + n) for o, n in zip(b.offsets, b.sizes))] += 1
        assert seen.eq(1).all(), (spec.name, seen)
        want = box_part(Box((0, 0), (11, 6)))
        got = sorted((r, p.box) for r, p in plan.writers(i, want))
        brute = sorted((r, layout.box(spec.shape, world, r)) for r in range(world)
                       for p in plan.rank_plan(r).pieces if p.spec_index == i)
        assert got == brute
    writes = [sum(p.nbytes for p in plan.rank_plan(r).pieces) for r in range(world)]
    assert sharded_loads(plan.specs, world, plan.rules).tolist() == writes
    if "R" in codes:  # the replicas of a box take turns writing it
        replicas = [sum(writes[layout.rank_at(c)] for c in itertools.product(*map(range, mesh)) if c[0] == q)
                    for q in range(mesh[0])]
        assert max(replicas) - min(replicas) <= 11 * 6 * 4, replicas


# -- the reshard matrix on the fake backend -----------------------------------------------------
# name -> global shape; awkward sizes on purpose (7 rows over 2 x 2, 13 columns)
GLOBAL = {"tok": (10, 6), "wq": (7, 13), "wo": (13, 7), "norm": (5,), "qkv": (6, 4)}
TITAN = {  # torchtitan's placements on (fsdp, tp): colwise, rowwise, norms, the fused-QKV views
    "tok": ("SS0:2", "S0"), "wq": ("SS0:2", "S0"), "wo": ("S0", "S1"), "norm": ("S0", "R"), "qkv": ("R", "R"),
}


def _in_fake_world(rank: int, world: int, mesh: tuple, fn, table=None):
    """Run ``fn(device_mesh)`` as ``rank`` of a fake world (``table``: the mesh's rank
    table, row-major; default in order); the group is gone after."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        if table is not None:
            return fn(DeviceMesh("cpu", torch.tensor(table).view(mesh)))
        return fn(init_device_mesh("cpu", mesh))
    finally:
        dist.destroy_process_group()


def _dtensors(world_mesh, layouts: dict, shapes: dict, fill: bool) -> dict:
    """This rank's DTensors: each local piece cut from the global tensor where torch says it
    is. A layout is placement codes on the world's mesh, or ``(mesh shape, codes)`` for a
    per-parameter mesh over the same ranks (experts on (efsdp, ep))."""
    from torch.distributed.device_mesh import init_device_mesh

    out = {}
    for name, codes in layouts.items():
        mesh = world_mesh
        if isinstance(codes[0], tuple):
            mesh = init_device_mesh("cpu", codes[0])
            codes = codes[1]
        out[name] = dtensor_on(mesh, name, shapes[name], codes, fill)
    return out


def save_on_mesh(url: str, mesh: tuple, layouts: dict, shapes: dict = GLOBAL) -> str:
    """Every rank of a ``mesh``-shaped world saves its DTensors; rank 0 last (it commits)."""
    world, run = math.prod(mesh), uuid.uuid4().hex[:8]
    handles, cks = [], []
    for rank in list(range(1, world)) + [0]:
        state = _in_fake_world(rank, world, mesh, lambda m: _dtensors(m, layouts, shapes, fill=True))
        ck = Checkpointer(url, rank=rank, world_size=world, run_id=run)
        h = ck.save(1, {"model": state})
        h.wait_staged()
        handles.append(h)
        cks.append(ck)
    for h in handles[::-1]:
        h.result(timeout=60)
    for ck in cks:
        ck.close()
    return run


def load_on_mesh(url: str, mesh: tuple, layouts: dict, shapes: dict = GLOBAL, table=None) -> list:
    """Every rank of the target world loads; returns (rank, name, local, want, stats) rows."""
    world = math.prod(mesh)
    rows = []
    for rank in range(world):
        if mesh:
            state = _in_fake_world(rank, world, mesh, lambda m: _dtensors(m, layouts, shapes, fill=False), table)
            locals_ = {n: t._local_tensor for n, t in state.items()}
        else:  # plain tensors
            state = {n: torch.full(shapes[n], float("nan")) for n in layouts}
            locals_ = state
        with Checkpointer(url, rank=rank, world_size=world, run_id="load") as ck:
            ck.load({"model": state})
            stats = ck.last_load_stats
        for name, local in locals_.items():
            if mesh:
                codes, on = layouts[name], mesh
                if isinstance(codes[0], tuple):
                    on, codes = codes
                sizes, offsets = torch_piece(shapes[name], on, list(MeshLayout(on, codes, table).coordinate(rank)),
                                             [_torch_placement(c) for c in codes])
                want = _global(name, shapes[name])[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))]
            else:
                want = _global(name, shapes[name])
            rows.append((rank, name, local, want, stats))
    return rows


HSDP_TP = {n: ("R", *c) for n, c in TITAN.items()}
TARGETS = {
    "fsdp4": ((4,), {n: ("S0",) for n in GLOBAL}),
    "fsdp1_tp2": ((1, 2), {n: ("S0", c[1]) for n, c in TITAN.items()}),
    "tp4": ((4,), {"tok": ("S0",), "wq": ("S0",), "wo": ("S1",), "norm": ("R",), "qkv": ("R",)}),
    "plain": ((), {n: None for n in GLOBAL}),
    "hsdp_tp": ((2, 2, 2), HSDP_TP),
    "transposed": ((2, 2), {n: ("S1" if len(GLOBAL[n]) > 1 else "S0", "S0") for n in GLOBAL}),
}
PERMUTED = (1, 0, 3, 2)  # a mesh whose rank table is not in order: a position comes from the table


@pytest.mark.parametrize("source", ["fsdp2_tp2", "hsdp_tp"])
def test_reshard_matrix_is_bit_exact_and_reads_only_what_each_rank_holds(tmp_path, source):
    mesh, layouts = ((2, 2), TITAN) if source == "fsdp2_tp2" else ((2, 2, 2), HSDP_TP)
    url = str(tmp_path / source)
    save_on_mesh(url, mesh, layouts)
    with Checkpointer(url) as ck:
        saved = ck.contents().by_name().tensors
    assert saved["model/wo"].layout == MeshLayout(mesh, layouts["wo"]) and saved["model/qkv"].layout.to_json() == {"kind": "replicate"}
    for target, (tmesh, tlayouts) in TARGETS.items():
        if target == source:
            continue
        rows = load_on_mesh(url, tmesh, tlayouts, table=PERMUTED if target == "transposed" else None)
        bad = [(target, rank, name) for rank, name, local, want, _ in rows if not _bits_equal(local, want)]
        assert bad == []
        for rank in {r[0] for r in rows}:
            stats = rows[[r[0] for r in rows].index(rank)][4]
            held = sum(r[2].numel() * 4 for r in rows if r[0] == rank)
            # the bound of docs/DESIGN.md: whole chunks of the runs wanted; these tensors are a
            # few hundred bytes, so each saved piece a rank reads is one chunk (or two)
            assert stats.fetches <= stats.chunks <= 2 * len(GLOBAL) * math.prod(mesh)
            assert stats.bytes_read <= 64 * 1024 * stats.chunks and held


def test_load_of_a_box_reads_whole_runs_within_the_stated_bound(tmp_path):
    """(fsdp 2, tp 2) -> (fsdp 4) and -> (tp 4) of two 1,024 x 1,024 float32 matrices (4 MiB
    each). The bound of docs/DESIGN.md: requests per rank <= the saved pieces its piece meets
    (adjacent chunks coalesce into one request); bytes read per tensor <= bytes held x (the
    saved box's width / the width wanted of it, over the dims after the first) + a chunk at
    each end of each saved piece met, and never more than those saved pieces whole."""
    shapes = {"wo": (1024, 1024), "wq": (1024, 1024)}
    layouts = {"wo": ("S0", "S1"), "wq": ("SS0:2", "S0")}  # boxes of 512 x 512, and slabs of 256 x 1024
    url = str(tmp_path / "big")
    save_on_mesh(url, (2, 2), layouts, shapes)
    chunk = 64 << 10  # pieces of 1 MiB get chunks of 1/16 = 64 KiB
    for tlayouts, widths, met in [({"wo": ("S0",), "wq": ("S0",)}, {"wo": 1, "wq": 1}, {"wo": 2, "wq": 1}),
                                  ({"wo": ("S1",), "wq": ("S1",)}, {"wo": 2, "wq": 4}, {"wo": 2, "wq": 4})]:
        rows = load_on_mesh(url, (4,), tlayouts, shapes)
        assert all(_bits_equal(local, want) for _, _, local, want, _ in rows)
        for rank in range(4):
            stats = rows[2 * rank][4]
            held = {r[1]: r[2].numel() * 4 for r in rows if r[0] == rank}
            assert stats.fetches <= sum(met.values()), (tlayouts, rank, stats)
            bound = sum(held[n] * widths[n] + 2 * met[n] * chunk for n in held)
            assert stats.bytes_read <= min(bound, sum(met[n] * (1 << 20) for n in held)), (tlayouts, rank, stats)


# -- the property test: random shapes, meshes and placements, save under one, load under another --
def _is_box_everywhere(shape, mesh, codes) -> bool:
    layout = MeshLayout(mesh, codes)
    try:
        for r in range(layout.size):
            layout.box(shape, layout.size, r)
    except ValueError:
        return False
    return True


@settings(max_examples=50, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**32 - 1))
def test_any_mesh_and_placement_round_trips_through_any_other(tmp_path_factory, seed):
    rng = random.Random(seed)  # uniform cases: dims not divisible by the mesh, 1-3 mesh dims, up to 8 ranks
    shape = tuple(rng.randint(0, 9) for _ in range(rng.randint(1, 3)))
    smesh, dmesh = _random_mesh(rng, 8), _random_mesh(rng, 8)
    scodes, dcodes = _random_placements(rng, len(shape), smesh), _random_placements(rng, len(shape), dmesh)
    assume(_is_box_everywhere(shape, smesh, scodes) and _is_box_everywhere(shape, dmesh, dcodes))
    url = str(tmp_path_factory.mktemp("prop"))
    save_on_mesh(url, smesh, {"x": scodes}, {"x": shape})
    rows = load_on_mesh(url, dmesh, {"x": dcodes}, {"x": shape})
    assert all(_bits_equal(local, want) for _, _, local, want, _ in rows), (shape, smesh, scodes, dmesh, dcodes)


def test_sharded_tensor_with_a_mesh_layout_holds_its_box():
    t = torch.arange(35.0).view(5, 7)
    layout = MeshLayout((2, 2), ("S0", "S1"))
    pieces = [ShardedTensor.from_global(t, layout, rank=r, world_size=4) for r in range(4)]
    assert pieces[1].local.tolist() == t[0:3, 4:7].tolist()
    assert part_of(layout, (5, 7), 4, 3) == box_part(Box((3, 4), (2, 3)))
    assert part_of(Shard(0), (5, 7), 4, 1) == flat_part((5, 7), 14, 28)


# -- the tools take a mesh and placements as a target -------------------------------------------
def test_plan_and_reshard_take_a_target_mesh_and_placements(tmp_path, capsys):
    from flexckpt.cli import main
    from flexckpt.catalog import read_manifest
    from flexckpt.restore_plan import restore_plan
    from flexckpt.storage import Storage

    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    save_on_mesh(src, (2, 2), TITAN)
    tp4 = ["--mesh", "tp=4", "--layout", "model/wo=S1", "--layout", "model/norm=R", "--layout", "model/qkv=R",
           "--layout", "model/w[q]=S0", "--layout", "model/tok=S0"]
    assert main(["plan", src, "--world", "4", *tp4]) == 0
    out = capsys.readouterr().out
    assert "on 4 ranks" in out and len([line for line in out.splitlines() if line.strip()[:1].isdigit()]) == 4
    # the library function: each rank holds exactly its box, and reads within the bound
    m = read_manifest(Storage(src), 1)
    layouts = {n: MeshLayout((4,), TARGETS["tp4"][1][n.split("/")[1]]) for n in m.tensors}
    plan = restore_plan(m, layouts, 4)
    for r in plan.ranks:
        assert r.holds == sum(4 * part_of(layouts[n], t.shape, 4, r.rank).box.numel for n, t in m.tensors.items())
        assert r.requests <= r.chunks <= len(GLOBAL) * 4
    # a tensor saved on a mesh keeps its placements on the new mesh; rewrite for (fsdp 1, tp 2) at W=2
    assert main(["reshard", src, dst, "--world", "2", "--mesh", "fsdp=1,tp=2"]) == 0
    with Checkpointer(dst) as ck:
        tensors = ck.contents().by_name().tensors
    assert tensors["model/wo"].layout == MeshLayout((1, 2), ("S0", "S1"))
    rows = load_on_mesh(dst, (1, 2), TARGETS["fsdp1_tp2"][1])
    assert all(_bits_equal(local, want) for _, _, local, want, _ in rows)
    # errors name the value and the fix, on one line
    for argv, msg in [(["--world", "2"], "saved on mesh (2, 2), which does not span 2 ranks"),
                      (["--world", "4", "--mesh", "2,2", "--layout", "model/*=S0"], "has 1 placements; give a target mesh of as many dims"),
                      (["--world", "2", "--mesh", "2,2"], "spans 4 ranks, --world is 2"),
                      (["--world", "4", "--mesh", "4", "--layout", "model/*=R", "--layout", "model/tok=SS0:2"], "strided set of indices")]:
        with pytest.raises(SystemExit) as e:
            code = main(["plan", src, *argv])
            raise SystemExit(code)
        assert msg in str(e.value) + capsys.readouterr().err, argv


def test_a_mesh_may_span_part_of_the_world_as_a_pipeline_stage_does():
    """Two stages of (fsdp 2, tp 2) in a world of 8: each stage's tensors live on its ranks
    only; every element is written once, by a rank of its stage, and a load at (fsdp 8)
    finds every piece."""
    stage = [MeshLayout((2, 2), ("SS0:2", "S0"), offset=4 * s) for s in range(2)]
    assert stage[1].coordinate(5) == (0, 1) and stage[1].coordinate(3) is None
    assert stage[1].box((9, 4), 8, 2).numel == 0 and stage[1].rank_table() == [4, 5, 6, 7]
    assert MeshLayout((2, 2), ("S0", "S1"), (5, 4, 7, 6)) == MeshLayout((2, 2), ("S0", "S1"), (1, 0, 3, 2), offset=4)
    specs = [TensorSpec(f"layers.{i}.w", torch.float32, (9, 4), stage[i]) for i in range(2)]
    plan = WritePlan(specs, 8, PlanRules(256))
    for i, spec in enumerate(plan.specs):
        writers = {r for r in range(8) for p in plan.rank_plan(r).pieces if p.spec_index == i}
        assert writers == set(stage[i].rank_table())
        assert sum(p.nbytes for r in range(8) for p in plan.rank_plan(r).pieces if p.spec_index == i) == 9 * 4 * 4
        target = part_of(Shard(0), spec.shape, 8, 3)  # rows [6, 8) at (fsdp 8)
        got = sorted((r, p.box) for r, p in plan.writers(i, target) if len(runs(p, target)))
        assert got == sorted((r, stage[i].box(spec.shape, 8, r)) for r in stage[i].rank_table()
                             if len(runs(box_part(stage[i].box(spec.shape, 8, r)), target)))
    # rules 4: a stage's tensors stay out of the balancer of replicated tensors (another stage
    # does not know them); rules 3 counted them
    assert sharded_loads(plan.specs, 8, plan.rules).tolist() == [0] * 8
    v3 = WritePlan(specs, 8, PlanRules(256, version=3))
    assert sharded_loads(v3.specs, 8, v3.rules).tolist() == [sum(p.nbytes for p in v3.rank_plan(r).pieces) for r in range(8)]
    with pytest.raises(ValueError, match="reaches rank 7, the world has 4 ranks"):
        WritePlan(specs, 4, PlanRules(256))


def test_experts_on_their_own_efsdp_ep_mesh_reshard_to_another_expert_degree():
    """torchtitan's MoE under FSDP2 + EP: experts on (efsdp, ep), the rest on the dp mesh;
    ``(_StridedShard(0, sf=ep), Shard(0))``, or ``(Shard(1), Shard(0))`` when efsdp x ep
    exceeds the expert count. Saved at (efsdp 2, ep 2), loaded at (efsdp 1, ep 4), (efsdp 4,
    ep 1) and as plain tensors."""
    shapes = {"experts.w1": (4, 6, 5), "experts.w2": (2, 5, 6), "dense": (7, 3)}
    saved = {"experts.w1": ((2, 2), ("SS0:2", "S0")), "experts.w2": ((2, 2), ("S1", "S0")), "dense": ("S0",)}
    import tempfile
    with tempfile.TemporaryDirectory() as url:
        save_on_mesh(url, (4,), saved, shapes)
        with Checkpointer(url) as ck:
            layouts = {n: t.layout for n, t in ck.contents().by_name().tensors.items()}
        assert layouts["model/experts.w1"] == MeshLayout((2, 2), ("SS0:2", "S0"))
        for target in ({"experts.w1": ((1, 4), ("S0", "S0")), "experts.w2": ((1, 4), ("S1", "S0")), "dense": ("S0",)},
                       {"experts.w1": ((4, 1), ("S0", "S0")), "experts.w2": ((4, 1), ("S1", "S0")), "dense": ("R",)}):
            rows = load_on_mesh(url, (4,), target, shapes)
            assert all(_bits_equal(local, want) for _, _, local, want, _ in rows)
        rows = load_on_mesh(url, (), {n: None for n in shapes}, shapes)
        assert all(_bits_equal(local, want) for _, _, local, want, _ in rows)


def _stage_state(rank: int, world: int, stages: int, layers: int, shape=(6, 5)) -> dict:
    """Every layer's weight on its pipeline stage's own (fsdp, tp 2) mesh, ranks
    ``[s * W / stages, (s + 1) * W / stages)``; a rank of another stage holds an empty piece."""
    per = world // stages
    state = {}
    for i in range(layers):
        layout = MeshLayout((per // 2, 2) if per > 1 else (1, 1), ("S0", "S1"), offset=(i * stages // layers) * per)
        state[f"layers.{i}.w"] = ShardedTensor.from_global(_global(f"layers.{i}.w", shape), layout, rank=rank, world_size=world)
    return state


def test_pipeline_stages_on_meshes_of_their_own_reload_at_one_and_four_stages_and_a_missing_layer_is_named(tmp_path):
    """2 stages of 2 ranks (each a (fsdp 1, tp 2) mesh) saved, loaded at 1 stage of 2 and 4
    stages of 8 ranks: every layer is found where it was saved, bit for bit. A layer the
    target wants and the checkpoint lacks stops the load, naming it (Megatron-LM #7452 copied
    another stage's layers instead)."""
    from flexckpt.errors import StructureMismatch

    url, run = str(tmp_path / "pp"), uuid.uuid4().hex[:8]
    cks = [Checkpointer(url, rank=r, world_size=4, run_id=run) for r in range(4)]
    hs = []
    for r in (1, 2, 3, 0):
        h = cks[r].save(1, {"model": _stage_state(r, 4, 2, 4)})
        h.wait_staged()
        hs.append(h)
    for h in hs[::-1]:
        h.result(timeout=60)
    for ck in cks:
        ck.close()
    for world, stages in ((2, 1), (8, 4)):
        for r in range(world):
            target = _stage_state(r, world, stages, 4)
            for st_ in target.values():
                st_.local.fill_(float("nan"))
            with Checkpointer(url, rank=r, world_size=world, run_id="pp") as ck:
                ck.load({"model": target})
            want = _stage_state(r, world, stages, 4)
            assert all(_bits_equal(target[n].local, want[n].local) for n in want), (world, r)
    target = _stage_state(0, 2, 1, 5)  # a fifth layer: the checkpoint has four
    with Checkpointer(url, rank=0, world_size=2, run_id="pp") as ck:
        with pytest.raises(StructureMismatch, match=r"has no tensors \['model/layers.4.w'\].*strict=False"):
            ck.load({"model": target})


def test_an_empty_piece_of_any_shape_is_taken_as_the_rank_s_empty_box():
    """3 experts at ep 4 then FSDP2's Shard(1) on efsdp: rank 3 holds no expert, and
    fully_shard hands its piece as [0, 0, 8], not the box's [0, 4, 8] (seen in a gloo run).
    A non-empty piece of the wrong shape is still refused."""
    from torch.distributed.tensor import Shard as DShard

    from flexckpt.state.dtensor import dtensor_leaf

    def leaf(local):
        def make(mesh):
            d = DTensor.from_local(local, mesh, [DShard(1), DShard(0)], run_check=False, shape=torch.Size((3, 4, 8)),
                                   stride=(32, 8, 1))
            return dtensor_leaf(d, "experts.w1", 3, 4)
        return _in_fake_world(3, 4, (1, 4), make)

    got, layout, shape = leaf(torch.empty(0, 0, 8))
    assert tuple(got.shape) == (0, 4, 8) and layout == MeshLayout((1, 4), ("S1", "S0")) and shape == (3, 4, 8)
    with pytest.raises(ValueError, match=r"local tensor has shape \[1, 4, 8\], but its mesh coordinate gives it a piece of "
                                         r"shape \[0, 4, 8\]"):
        leaf(torch.zeros(1, 4, 8))
