"""Layout range math, without processes or files."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from flexshard import (
    BlockShard,
    FlatRange,
    HybridShard,
    MeshLayout,
    Owned,
    Replicate,
    Shard,
    ShardedTensor,
    assign_owners,
    covering,
    layout_from_json,
    local_shape,
    overlaps,
    part_of,
    rank_loads,
)

AWKWARD_SHAPES = [
    (), (0,), (0, 5), (1,), (1, 7), (7,), (5, 3), (10, 0), (31,), (32,), (33, 4), (64, 2),
    (65, 3), (96, 8), (97, 5), (100,), (1000, 3), (50257,), (3, 4, 5),
]
SHARDING = [Shard(0), BlockShard(32), BlockShard(1), BlockShard(7), Owned(0)]


def pieces(layout, shape, world):
    return [layout.flat_range(shape, world, r) for r in range(world)]


@pytest.mark.parametrize("shape", AWKWARD_SHAPES)
@pytest.mark.parametrize("world", range(1, 10))
@pytest.mark.parametrize("layout", SHARDING, ids=repr)
def test_sharding_layouts_partition_the_flat_range(layout, shape, world):
    n = math.prod(shape)
    ranges = pieces(layout, shape, world)
    pos = 0
    for r in ranges:
        if len(r):
            assert r.start == pos, f"gap or overlap at {pos}: {ranges}"
            pos = r.stop
    assert pos == n
    assert sum(len(r) for r in ranges) == n
    for rank, r in enumerate(ranges):
        assert math.prod(local_shape(layout, shape, world, rank)) == len(r)


@pytest.mark.parametrize("shape", AWKWARD_SHAPES)
@pytest.mark.parametrize("world", range(1, 10))
def test_replicate_gives_every_rank_everything(shape, world):
    n = math.prod(shape)
    assert pieces(Replicate(), shape, world) == [FlatRange(0, n)] * world
    assert all(local_shape(Replicate(), shape, world, r) == shape for r in range(world))


@pytest.mark.parametrize("world", range(1, 10))
@pytest.mark.parametrize("shape", [(33, 4), (96, 8), (50257,), (1,), (0, 3), (65,)])
@pytest.mark.parametrize("block", [1, 7, 32])
def test_block_shard_edges_fall_on_block_edges(world, shape, block):
    per_row = math.prod(shape[1:])
    for r in pieces(BlockShard(block), shape, world):
        if len(r):
            assert (r.start // per_row) % block == 0
            assert (r.stop // per_row) % block == 0 or r.stop == math.prod(shape)


def test_owned_gives_the_owner_everything_and_others_nothing():
    assert pieces(Owned(2), (4, 5), 4) == [FlatRange(0, 0), FlatRange(0, 0), FlatRange(0, 20), FlatRange(0, 0)]
    assert local_shape(Owned(2), (4, 5), 4, 1) == (0, 5)
    with pytest.raises(ValueError, match="assign_owners"):
        Owned(4).flat_range((4, 5), 4, 0)


def test_exact_ranges_for_known_cases():
    assert pieces(Shard(0), (10, 3), 4) == [(0, 9), (9, 18), (18, 27), (27, 30)]
    # 96 rows on 5 ranks: Shard(0) cuts at 20 rows (not a multiple of 32); BlockShard at 32
    assert [tuple(r) for r in pieces(Shard(0), (96, 2), 5)] == [(0, 40), (40, 80), (80, 120), (120, 160), (160, 192)]
    assert [tuple(r) for r in pieces(BlockShard(32), (96, 2), 5)] == [(0, 64), (64, 128), (128, 192), (192, 192), (192, 192)]
    # the GPT-2 vocabulary on 4 ranks: 1571 blocks of 32 rows, 393 per rank
    assert [tuple(r) for r in pieces(BlockShard(32), (50257,), 4)] == [
        (0, 12576), (12576, 25152), (25152, 37728), (37728, 50257)
    ]
    assert [tuple(r) for r in pieces(Shard(0), (), 3)] == [(0, 1), (1, 1), (1, 1)]
    assert local_shape(Shard(0), (7, 2), 3, 2) == (1, 2)
    assert local_shape(Shard(0), (10, 0), 4, 3) == (1, 0)


def test_layouts_reject_bad_arguments():
    with pytest.raises(ValueError, match="Shard"):
        Shard(1)
    with pytest.raises(ValueError, match="block_size"):
        BlockShard(0)
    with pytest.raises(ValueError, match="owner"):
        Owned(-1)
    with pytest.raises(ValueError, match="rank"):
        Shard(0).flat_range((4,), 2, 2)
    with pytest.raises(ValueError, match="world_size"):
        Replicate().flat_range((4,), 0, 0)
    with pytest.raises(ValueError, match=">= 0"):
        Shard(0).flat_range((-1, 2), 2, 0)


@pytest.mark.parametrize(
    "layout", [Replicate(), Shard(0), Owned(3), BlockShard(32), BlockShard(5), HybridShard(8), HybridShard(8, 32)], ids=repr
)
def test_layout_json_round_trips(layout):
    assert layout_from_json(layout.to_json()) == layout


@pytest.mark.parametrize(
    "bad",
    [None, [], {"kind": 3}, {"kind": "cyclic"}, {"kind": "owned"}, {"kind": "owned", "owner": "1"},
     {"kind": "owned", "owner": True}, {"kind": "shard", "dim": 1}, {"kind": "block_shard", "block_size": 0},
     {"kind": "replicate", "evil": 1}],
)
def test_layout_from_json_rejects_junk(bad):
    with pytest.raises((ValueError, TypeError)):
        layout_from_json(bad)


def test_intersection_and_overlaps():
    assert FlatRange(0, 10).intersect(FlatRange(5, 20)) == FlatRange(5, 10)
    assert FlatRange(0, 10).intersect(FlatRange(10, 20)) is None
    assert FlatRange(3, 3).intersect(FlatRange(0, 10)) is None
    hits = overlaps(FlatRange(5, 25), [FlatRange(0, 10), FlatRange(10, 20), FlatRange(20, 30)])
    assert hits == [(5, 10, 0, 5, 0), (10, 20, 1, 0, 5), (20, 25, 2, 0, 15)]


def _hybrid(layout, world):
    """A HybridShard needs a group size that divides the world: use the largest that does."""
    if not isinstance(layout, HybridShard):
        return layout
    group = max(g for g in range(1, min(layout.group_size, world) + 1) if world % g == 0)
    return HybridShard(group, layout.block_size)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    rows=st.integers(0, 300), cols=st.integers(1, 5),
    src_world=st.integers(1, 9), dst_world=st.integers(1, 9), dst_rank=st.integers(0, 8),
    src=st.sampled_from([Shard(0), BlockShard(32), BlockShard(3), Owned(0), HybridShard(2), HybridShard(3, 4)]),
    dst=st.sampled_from([Shard(0), BlockShard(32), BlockShard(3), Replicate(), HybridShard(2), HybridShard(4, 3)]),
)
def test_resharding_cover_rebuilds_any_target_piece(rows, cols, src_world, dst_world, dst_rank, src, dst):
    dst_rank %= dst_world
    src, dst = _hybrid(src, src_world), _hybrid(dst, dst_world)
    shape = (rows, cols)
    full = torch.arange(rows * cols)
    saved = [ShardedTensor.from_global(full.view(shape), src, r, src_world) for r in range(src_world)]
    target_range = dst.flat_range(shape, dst_world, dst_rank)
    got = torch.full((len(target_range),), -1, dtype=full.dtype)
    for ov in covering(target_range, [s.flat_range for s in saved]):  # replicas: the first holder
        n = ov.stop - ov.start
        got[ov.target_offset : ov.target_offset + n] = saved[ov.source_index].local.reshape(-1)[
            ov.source_offset : ov.source_offset + n
        ]
    assert torch.equal(got, full[target_range.start : target_range.stop])


HYBRID = [HybridShard(1), HybridShard(2), HybridShard(3, 4), HybridShard(4, 32), HybridShard(9, 1)]


@pytest.mark.parametrize("shape", AWKWARD_SHAPES)
@pytest.mark.parametrize("world", range(1, 10))
@pytest.mark.parametrize("layout", HYBRID, ids=repr)
def test_hybrid_shard_is_the_inner_layout_in_every_group(layout, shape, world):
    if world % layout.group_size:
        with pytest.raises(ValueError, match=f"group_size={layout.group_size}.*world_size={world}"):
            layout.flat_range(shape, world, 0)
        return
    n = math.prod(shape)
    g = layout.group_size
    inner = Shard(0) if layout.block_size is None else BlockShard(layout.block_size)
    got = pieces(layout, shape, world)
    assert got == [inner.flat_range(shape, g, r % g) for r in range(world)]
    for r in range(world):
        assert local_shape(layout, shape, world, r) == local_shape(inner, shape, g, r % g)


def test_hybrid_shard_exact_ranges_and_errors():
    # 10 rows of 3 in groups of 2 over 4 ranks: ranks 0 and 2 hold rows 0-4, ranks 1 and 3 rows 5-9
    assert pieces(HybridShard(2), (10, 3), 4) == [(0, 15), (15, 30), (0, 15), (15, 30)]
    # BlockShard(32) inside groups of 4: the GPT-2 vocabulary over 8 ranks
    assert pieces(HybridShard(4, 32), (50257,), 8)[5] == BlockShard(32).flat_range((50257,), 4, 1)
    with pytest.raises(ValueError, match="group_size=3.*world_size=4.*divides"):
        HybridShard(3).flat_range((4,), 4, 0)
    with pytest.raises(ValueError, match="group_size"):
        HybridShard(0)
    with pytest.raises(ValueError, match="block_size"):
        HybridShard(2, 0)
    with pytest.raises(ValueError, match="block_size"):
        HybridShard(2, True)
    assert layout_from_json({"kind": "hybrid_shard", "group_size": 2, "block_size": None}) == HybridShard(2)
    with pytest.raises(ValueError):
        layout_from_json({"kind": "hybrid_shard", "group_size": "2"})


def test_covering_reports_missing_elements():
    with pytest.raises(ValueError, match="element 5"):
        covering(FlatRange(0, 10), [FlatRange(0, 5), FlatRange(6, 10)])


def test_sharded_tensor_checks_its_piece():
    st_ = ShardedTensor.from_global(torch.arange(10.0).view(5, 2), Shard(0), rank=1, world_size=2)
    assert st_.local.tolist() == [[6.0, 7.0], [8.0, 9.0]]
    assert st_.flat_range == FlatRange(6, 10)
    with pytest.raises(ValueError, match="flat range"):
        ShardedTensor(torch.zeros(3), Shard(0), (5, 2), rank=1, world_size=2)
    with pytest.raises(TypeError):
        ShardedTensor([1, 2], Shard(0), (2,), 0, 1)
    empty = ShardedTensor.empty((5, 2), Owned(1), rank=0, world_size=2)
    assert empty.local.shape == (0, 2)
    assert ShardedTensor.from_global(torch.ones(3), Replicate()).world_size == 1


def test_assign_owners_is_deterministic_balanced_and_order_free():
    costs = {f"w{i}": float((i * 37) % 11 + 1) for i in range(40)}
    a = assign_owners(costs, 4)
    b = assign_owners(dict(reversed(list(costs.items()))), 4)
    assert a == b
    loads = rank_loads(costs, a, 4)
    assert max(loads) - min(loads) <= max(costs.values())
    assert assign_owners({"b": 1, "a": 1, "c": 5}, 2) == {"c": 0, "a": 1, "b": 1}
    with pytest.raises(ValueError, match="cost"):
        assign_owners({"x": float("nan")}, 2)


# -- the answers part_of and layout_from_json keep (a load asks them once a tensor) ----------
def _uncached_part(layout, shape, world, rank):
    from flexshard.layout import _part_of

    return _part_of(layout, shape, world, rank)


KEPT_LAYOUTS = [Replicate(), Shard(0), BlockShard(1), BlockShard(7), BlockShard(32), Owned(0), Owned(2), HybridShard(1),
                HybridShard(2), HybridShard(2, 3), MeshLayout((2, 2), ("S0", "S1")), MeshLayout((2, 2), ("R", "S0")),
                MeshLayout((2,), ("S0",), offset=2)]


def test_part_of_kept_answers_equal_the_computation_for_every_layout_world_and_rank():
    from flexshard.layout import _PARTS

    _PARTS.clear()
    asked = 0
    for layout in KEPT_LAYOUTS:
        for shape in [(), (0,), (1,), (7,), (33, 4), (10, 0), (97, 5), (3, 4, 5), (64, 2)]:
            for world in range(1, 9):
                for rank in range(world):
                    try:
                        want = _uncached_part(layout, shape, world, rank)
                    except ValueError as e:  # refused (a world Owned(2) or a mesh does not fit): refused again, kept or not
                        for _ in range(2):
                            with pytest.raises(ValueError) as got:
                                part_of(layout, shape, world, rank)
                            assert str(got.value) == str(e)
                        continue
                    # a miss, a hit, and the shape as torch gives it (equal key) and as a list (not kept)
                    for s in (shape, shape, torch.Size(shape), list(shape)):
                        assert part_of(layout, s, world, rank) == want, (layout, shape, world, rank)
                    asked += 1
    assert asked > 1500 and len(_PARTS) == asked


def test_part_of_refuses_what_it_refused_before_whatever_it_kept():
    assert part_of(Shard(0), (8, 2), 4, 1) == part_of(Shard(0), (8, 2), 4, 1)  # kept
    for world, rank in ((4, 1.0), (4.0, 1), (4, 4), (4, -1)):  # 1.0 == 1 and hashes alike: never the kept answer
        with pytest.raises(ValueError, match="must be an int"):
            part_of(Shard(0), (8, 2), world, rank)
    with pytest.raises(ValueError, match="dimensions must be >= 0"):
        part_of(Shard(0), (-8, 2), 4, 1)
    with pytest.raises(TypeError):  # an unhashable dimension: the computation's own error
        part_of(Shard(0), ([8], 2), 4, 1)


def test_layout_from_json_kept_layouts_never_answer_json_of_another_type():
    assert layout_from_json({"kind": "owned", "owner": 1}) == Owned(1)
    assert layout_from_json({"kind": "owned", "owner": 1}) is layout_from_json({"kind": "owned", "owner": 1})
    for bad in ({"kind": "owned", "owner": True}, {"kind": "owned", "owner": 1.0}, {"kind": "shard", "dim": False},
                {"kind": "block_shard", "block_size": 0}, {"kind": "owned", "owner": 1, "x": 2}, {"kind": "Owned", "owner": 1}):
        for _ in range(2):  # refused, and nothing kept for it
            with pytest.raises(ValueError):
                layout_from_json(bad)
    assert layout_from_json({"kind": "hybrid_shard", "group_size": 2, "block_size": None}) == HybridShard(2)
    mesh = {"kind": "mesh", "mesh": [2, 2], "placements": ["S0", "R"], "ranks": None, "offset": 0}
    assert layout_from_json(mesh) == layout_from_json(dict(mesh)) == MeshLayout((2, 2), ("S0", "R"))
    with pytest.raises(ValueError, match="holds ints"):
        layout_from_json({**mesh, "mesh": [2, True]})


def test_global_numel_still_answers_but_warns_naming_its_replacement():
    t = ShardedTensor.from_global(torch.zeros(6, 4), Shard(0), rank=0, world_size=2)
    with pytest.warns(DeprecationWarning, match=r"math\.prod\(t\.global_shape\)"):
        assert t.global_numel == 24 == math.prod(t.global_shape)
