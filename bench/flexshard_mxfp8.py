"""MXFP8 quantize (and dequantize) throughput on this CPU, with torchao's ``to_mx``
(FLOOR mode, row blocks only: it has no column or tile mode) measured in the same run.

Throughput is fp32 input bytes per second (GB/s = 1e9 bytes/s), median over runs.

    python3 dev.py bench flexshard_mxfp8 [--rows 4096] [--cols 4096] [--runs 7] [--threads 1 2]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from flexshard.mxfp8 import dequantize, quantize  # noqa: E402


def _median_seconds(fn, runs: int) -> float:
    fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            from torchao.prototype.mx_formats.mx_tensor import to_mx
        except ImportError:  # the peer is optional
            to_mx = None
    x = torch.randn(args.rows, args.cols, generator=torch.Generator().manual_seed(0))
    gb = x.numel() * 4 / 1e9
    print(f"MXFP8 quantize, {args.rows} x {args.cols} fp32 ({gb * 1e3:.0f} MB), median of {args.runs} runs, "
          f"GB/s of fp32 input")
    header = f"{'threads':>7} {'blocks':>6} {'quantize GB/s':>14} {'dequantize GB/s':>16} {'torchao to_mx GB/s':>19} {'ours/torchao':>13}"
    print(header)
    print("-" * len(header))
    for threads in args.threads:
        torch.set_num_threads(threads)
        peer = None
        if to_mx is not None:
            peer = gb / _median_seconds(lambda: to_mx(x, torch.float8_e4m3fn, 32), args.runs)
        for blocks in ("row", "column", "tile"):
            q = gb / _median_seconds(lambda: quantize(x, blocks=blocks), args.runs)
            mx = quantize(x, blocks=blocks)
            dq = gb / _median_seconds(lambda: dequantize(mx), args.runs)
            if blocks == "row" and peer is not None:
                print(f"{threads:>7} {blocks:>6} {q:>14.2f} {dq:>16.2f} {peer:>19.2f} {q / peer:>13.2f}")
            else:
                print(f"{threads:>7} {blocks:>6} {q:>14.2f} {dq:>16.2f} {'-':>19} {'-':>13}")


if __name__ == "__main__":
    main()
