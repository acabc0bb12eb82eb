"""Gathers by layout: the quantized all-gather of BlockShard pieces is bit-identical to
gathering fp32 and quantizing after; the Shard(0) baseline gathers bf16; Owned tensors
come by broadcast; and the bytes each rank reports match what gloo writes to its sockets.

All multi-process checks of one world size run in one launch (module-scoped fixture)."""

import pytest
import torch

from flexshard import BlockShard, Owned, Replicate, Shard, ShardedTensor
from flexshard.buckets import BucketPlan
from flexshard.collectives import WireStats, binomial_children, process_bytes_written
from flexshard.gather import (
    all_gather_bf16_then_quantize,
    all_gather_mx,
    all_gather_tensor,
    broadcast_owned,
    check_blocks_stay_whole,
    pack_mx,
    unpack_mx,
)
from flexshard.mxfp8 import quantize, wire_bytes
from flexshard.spawn import run_workers

# Row counts where ceil(rows / W) is not a multiple of 32 for some W in 1..4 (and 5..8 below).
SHAPES = [(50257, 64), (96, 40), (33, 64), (1000, 96), (1000,), (5, 64)]
ORIENTATIONS = ["row", "column", "tile"]


def global_tensor(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    rows = shape[0]
    scale = torch.exp2(torch.randint(-20, 20, (rows,), generator=g).float())
    return x * (scale if len(shape) == 1 else scale[:, None])


def orientations(shape):
    return ORIENTATIONS if len(shape) == 2 else ["row"]


def same_mx(a, b):
    return torch.equal(a.scale, b.scale) and torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))


class Metered:
    """Counts modeled bytes (WireStats) and bytes this process wrote (socket writes)."""

    def __init__(self):
        self.stats = WireStats()
        self.written = 0

    def run(self, fn, *args, **kwargs):
        before = process_bytes_written()
        out = fn(*args, stats=self.stats, **kwargs)
        after = process_bytes_written()
        if before is not None and after is not None:
            self.written += after - before
        return out


def _gather_checks(rank, world):
    out = {"fails": [], "wire": None}
    meter = Metered()

    def check(ok, what):
        if not ok:
            out["fails"].append(what)

    for shape in SHAPES:
        full = global_tensor(shape)
        block = ShardedTensor.from_global(full, BlockShard(32), rank, world)
        shard = ShardedTensor.from_global(full, Shard(0), rank, world)
        for blocks in orientations(shape):
            want = quantize(full, blocks=blocks)
            check(same_mx(meter.run(all_gather_mx, block, blocks), want), f"BlockShard mx {shape} {blocks}")
            base = meter.run(all_gather_bf16_then_quantize, shard, blocks)
            check(same_mx(base, quantize(full.bfloat16(), blocks=blocks)), f"Shard(0) bf16 {shape} {blocks}")
            try:
                check(same_mx(meter.run(all_gather_mx, shard, blocks), want), f"Shard(0) mx {shape} {blocks}")
                aligned = True
            except ValueError:
                aligned = False
            rows_per_rank = -(-shape[0] // world)
            expect_aligned = (blocks == "row" and len(shape) == 2) or rows_per_rank % 32 == 0 or world == 1
            check(aligned == expect_aligned, f"Shard(0) refusal {shape} {blocks}: aligned={aligned}")
        for layout in (Shard(0), BlockShard(32), Owned(world - 1)):
            piece = ShardedTensor.from_global(full, layout, rank, world)
            check(torch.equal(meter.run(all_gather_tensor, piece), full), f"fp32 gather {layout} {shape}")
        owner = (len(shape) + 1) % world
        mine = full if rank == owner else None
        check(torch.equal(meter.run(broadcast_owned, mine, shape, owner), full), f"broadcast {shape}")
        for blocks in orientations(shape):
            got = meter.run(broadcast_owned, mine, shape, owner, blocks=blocks)
            check(same_mx(got, quantize(full, blocks=blocks)), f"broadcast mx {shape} {blocks}")
    out["wire"] = (meter.stats.bytes_sent, meter.written, meter.stats.calls)
    # bytes for one vocabulary matrix, per orientation: BlockShard+MXFP8 vs Shard(0)+bf16
    full = global_tensor((50257, 64))
    ratios = {}
    for blocks in ORIENTATIONS:
        a, b = WireStats(), WireStats()
        all_gather_mx(ShardedTensor.from_global(full, BlockShard(32), rank, world), blocks, stats=a)
        all_gather_bf16_then_quantize(ShardedTensor.from_global(full, Shard(0), rank, world), blocks, stats=b)
        ratios[blocks] = (a.bytes_sent, b.bytes_sent, a.padding_bytes)
    out["ratios"] = ratios
    return out


@pytest.fixture(scope="module", params=[1, 2, 3, 4], ids=lambda w: f"world{w}")
def gathered(request):
    world = request.param
    if world == 1:  # no process group needed: every gather degenerates to a local copy
        return world, _gather_checks(0, 1)
    return world, run_workers(_gather_checks, world, timeout=150)


def _results(gathered):
    world, res = gathered
    return world, (res if isinstance(res, list) else [res])


def test_quantized_all_gather_is_bit_identical_to_gathering_fp32_then_quantizing(gathered):
    world, results = _results(gathered)
    for rank, res in enumerate(results):
        assert [f for f in res["fails"] if "BlockShard mx" in f] == [], f"rank {rank}"


def test_shard0_baseline_gathers_bf16_and_refuses_mx_where_column_blocks_straddle_ranks(gathered):
    world, results = _results(gathered)
    for rank, res in enumerate(results):
        assert [f for f in res["fails"] if "Shard(0)" in f] == [], f"rank {rank}"


def test_full_precision_gathers_and_owned_broadcasts_rebuild_the_tensor(gathered):
    world, results = _results(gathered)
    for rank, res in enumerate(results):
        assert [f for f in res["fails"] if "fp32" in f or "broadcast" in f] == [], f"rank {rank}"


def test_reported_wire_bytes_match_the_bytes_gloo_writes(gathered):
    world, results = _results(gathered)
    for rank, res in enumerate(results):
        modeled, written, calls = res["wire"]
        if world == 1:
            assert modeled == 0
            continue
        # gloo adds a small header per message; nothing else in the worker writes
        assert modeled <= written <= modeled + 4096 * calls, (rank, modeled, written, calls)


def test_mxfp8_all_gather_moves_about_half_the_bytes_of_bf16(gathered):
    world, results = _results(gathered)
    if world == 1:
        pytest.skip("no wire at world 1")
    for res in results:
        for blocks, (mx_bytes, bf16_bytes, padding) in res["ratios"].items():
            # 1 byte an element (+1/32 or +1/1024 for scales) against 2, plus padding
            assert mx_bytes / bf16_bytes <= 0.53, (blocks, mx_bytes, bf16_bytes, padding)


# --- pure: more ranks than this machine should spawn ------------------------------------------

@pytest.mark.parametrize("world", [5, 6, 7, 8])
@pytest.mark.parametrize("shape", [(96, 40), (50257, 8), (1000,), (65, 33)])
def test_unpacking_block_aligned_pieces_equals_quantizing_the_whole(shape, world):
    # The collective only moves bytes; emulate it by handing unpack_mx every rank's buffer.
    full = global_tensor(shape, seed=1)
    for blocks in orientations(shape):
        parts = [pack_mx(quantize(ShardedTensor.from_global(full, BlockShard(32), r, world).local, blocks=blocks))
                 for r in range(world)]
        assert same_mx(unpack_mx(parts, shape, BlockShard(32), world, blocks), quantize(full, blocks=blocks))


def test_96_rows_on_5_ranks_straddle_column_blocks_under_shard0_but_not_blockshard():
    with pytest.raises(ValueError, match=r"Shard\(dim=0\) gives rank 1 of 5 rows from 20.*BlockShard\(32\)"):
        check_blocks_stay_whole((96, 64), Shard(0), 5, "column")
    check_blocks_stay_whole((96, 64), Shard(0), 5, "row")  # rows never straddle
    check_blocks_stay_whole((96, 64), BlockShard(32), 5, "tile")
    with pytest.raises(ValueError, match="straddle"):
        check_blocks_stay_whole((50257,), Shard(0), 3, "row")  # 1-D row blocks run along dim 0


def test_bucket_plan_pads_every_rank_to_the_largest_and_packs_in_entry_order():
    plan = BucketPlan.for_layouts([((10, 3), Shard(0)), ((4,), Owned(1)), ((5,), Replicate())], 3)
    assert plan.sizes == ((12, 0, 5), (12, 4, 5), (6, 0, 5))
    assert plan.padded == 21 and [plan.padding(r) for r in range(3)] == [4, 0, 10]
    assert tuple(plan.slot(1, 2)) == (16, 21)
    packed = plan.pack([torch.arange(12.0), torch.ones(0), torch.full((5,), 7.0)], rank=0)
    assert packed.tolist() == list(range(12)) + [7.0] * 5 + [0.0] * 4


@pytest.mark.parametrize("world, sends", [(1, [0]), (2, [1, 0]), (3, [2, 0, 0]), (4, [2, 1, 0, 0]),
                                          (8, [3, 2, 1, 1, 0, 0, 0, 0])])
def test_binomial_broadcast_children(world, sends):
    assert [binomial_children(v, world) for v in range(world)] == sends


def test_wire_bytes_of_a_piece_match_its_packed_buffer():
    x = global_tensor((77, 50))
    for blocks in ORIENTATIONS:
        assert pack_mx(quantize(x, blocks=blocks)).numel() == wire_bytes((77, 50), blocks)
