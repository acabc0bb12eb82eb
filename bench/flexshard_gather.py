"""Parameter all-gather into an MXFP8 compute copy: BlockShard(32) + MXFP8 against the
Shard(0) + bf16 baseline, per block orientation, over gloo.

Both end with the same thing on every rank: the whole matrix as MXFP8 in the given
orientation. BlockShard: each rank quantizes its own rows (whole blocks) and the group
gathers element bytes and scales. Shard(0): its column blocks and tiles straddle ranks
(ceil(50257 / W) is not a multiple of 32), so it gathers bf16 and every rank quantizes the
whole matrix after. (Row blocks never straddle; the ``Shard(0)+MXFP8`` column shows that
case.) Bytes are what each rank sends, padding included, as flexshard's collectives report
them; time is the median over runs, rank 0, between barriers.

    python3 dev.py bench flexshard_gather [--rows 50257] [--cols 768] [--runs 5] [--worlds 2 4]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from flexshard import BlockShard, Shard, ShardedTensor, WireStats  # noqa: E402
from flexshard.gather import all_gather_bf16_then_quantize, all_gather_mx  # noqa: E402
from flexshard.spawn import run_workers  # noqa: E402

ORIENTATIONS = ("row", "column", "tile")


def _timed(fn, runs):
    times, stats = [], None
    for run in range(runs + 1):
        stats = WireStats()
        dist.barrier()
        t0 = time.perf_counter()
        fn(stats)
        dist.barrier()
        if run:
            times.append(time.perf_counter() - t0)
    return statistics.median(times), stats.bytes_sent, stats.padding_bytes


def _worker(rank: int, world: int, rows: int, cols: int, runs: int) -> dict:
    full = torch.randn(rows, cols, generator=torch.Generator().manual_seed(0))
    block = ShardedTensor.from_global(full, BlockShard(32), rank, world)
    shard = ShardedTensor.from_global(full, Shard(0), rank, world)
    del full
    out = {}
    for blocks in ORIENTATIONS:
        out[blocks] = {
            "blockshard_mx": _timed(lambda s: all_gather_mx(block, blocks, stats=s), runs),
            "shard0_bf16": _timed(lambda s: all_gather_bf16_then_quantize(shard, blocks, stats=s), runs),
        }
        if blocks == "row":
            out[blocks]["shard0_mx"] = _timed(lambda s: all_gather_mx(shard, blocks, stats=s), runs)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=50257)
    ap.add_argument("--cols", type=int, default=768)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    args = ap.parse_args()
    mib = args.rows * args.cols * 4 / 2**20
    print(f"parameter all-gather to an MXFP8 copy on every rank: {args.rows} x {args.cols} fp32 ({mib:.0f} MiB), "
          f"gloo, 1 thread per rank, median of {args.runs} runs (+1 warm-up)")
    header = (f"{'W':>2} {'blocks':>6} {'BlockShard+MX MiB':>18} {'Shard(0)+bf16 MiB':>18} {'bytes ratio':>11} "
              f"{'BlockShard+MX s':>16} {'Shard(0)+bf16 s':>16} {'time ratio':>10} {'Shard(0)+MX MiB':>16}")
    print(header)
    print("-" * len(header))
    for world in args.worlds:
        res = run_workers(_worker, world, args.rows, args.cols, args.runs, timeout=600)
        for blocks in ORIENTATIONS:
            mx_t, _, _ = res[0][blocks]["blockshard_mx"]
            bf_t, _, _ = res[0][blocks]["shard0_bf16"]
            mx_b = statistics.mean(r[blocks]["blockshard_mx"][1] for r in res) / 2**20
            bf_b = statistics.mean(r[blocks]["shard0_bf16"][1] for r in res) / 2**20
            s0 = (f"{statistics.mean(r[blocks]['shard0_mx'][1] for r in res) / 2**20:>16.2f}"
                  if "shard0_mx" in res[0][blocks] else f"{'straddles':>16}")
            print(f"{world:>2} {blocks:>6} {mx_b:>18.2f} {bf_b:>18.2f} {mx_b / bf_b:>11.3f} "
                  f"{mx_t:>16.3f} {bf_t:>16.3f} {mx_t / bf_t:>10.3f} {s0}")
    print("bytes: mean per rank of what it sends, padding included; goal: ratio <= 0.52 for one orientation")


if __name__ == "__main__":
    main()
