"""Optimizer phase, Owned Muon vs the FSDP-only Shard(0) baseline, over gloo.

The phase runs from "every rank holds its local gradients" to "every rank holds the
updated parameters": ``reduce_gradients()`` + ``step()`` of ``flexshard.ShardedOptimizer``
with ``placement="owned"`` and ``placement="fsdp"``, on the same processes, interleaved
run by run. Parameters: a stack of transformer-shaped matrices (per layer q, k, v, o of
d x d and an MLP of 4d x d and d x 4d), all under Muon.

Reported per world size: median wall time over the runs (rank 0, between barriers), bytes
sent per rank (modeled by flexshard's collectives and, on Linux, measured as the bytes
the process wrote, i.e. gloo's socket writes), Newton-Schulz FLOPs per rank (the largest),
the owner balance, and the reduction with the ceiling ``1 - 1/W`` that removing redundant
Newton-Schulz alone would allow.

    python3 dev.py bench flexshard_optimizer [--layers 20] [--d 512] [--runs 5] [--worlds 2 4]
    python3 dev.py bench flexshard_optimizer --flextrain-preset small --worlds 4 --runs 9

``--flextrain-preset`` takes flextrain's model of that preset instead (its parameters,
Muon on the blocks' matrices, AdamW on embedding, head and norms, as the trainer builds
it) and adds the per-phase medians (reduce, update, gather) and the AdamW share.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from flexshard import MuonConfig, ShardedOptimizer, ShardingConfig  # noqa: E402
from flexshard.collectives import process_bytes_written  # noqa: E402
from flexshard.spawn import run_workers  # noqa: E402


def shapes(layers: int, d: int) -> dict[str, tuple[int, int]]:
    out = {}
    for i in range(layers):
        for name in ("wq", "wk", "wv", "wo"):
            out[f"layers.{i}.attn.{name}"] = (d, d)
        out[f"layers.{i}.mlp.up"] = (4 * d, d)
        out[f"layers.{i}.mlp.down"] = (d, 4 * d)
    return out


def preset_model(preset: str) -> tuple[dict[str, tuple[int, ...]], list[str]]:
    """Parameter shapes of flextrain's model for ``preset`` and the ones it gives Muon."""
    from flextrain.config import load_config
    from flextrain.model import Transformer

    model = Transformer(load_config(preset).model)
    return {n: tuple(p.shape) for n, p in model.named_parameters()}, model.hidden_matrices()


def _worker(rank: int, world: int, layers: int, d: int, runs: int, preset: str | None = None) -> dict:
    g = torch.Generator().manual_seed(0)
    params = {}
    table, muon_params = (shapes(layers, d), None) if preset is None else preset_model(preset)
    for name, shape in table.items():
        p = (torch.randn(shape, generator=g) / shape[-1] ** 0.5).requires_grad_()
        params[name] = p
    gl = torch.Generator().manual_seed(1 + rank)  # each rank its own local gradients
    for p in params.values():
        p.grad = torch.randn(p.shape, generator=gl)
    opts = {
        placement: ShardedOptimizer(params, MuonConfig(lr=0.02), sharding=ShardingConfig(placement=placement),
                                    muon_params=muon_params)
        for placement in ("owned", "fsdp")
    }
    out = {p: {"times": [], "sent": [], "written": [], "ns": [], "padding": [], "phases": []} for p in opts}
    for run in range(runs + 1):  # the first run warms up and is not counted
        for placement, opt in opts.items():
            opt.stats.reset()
            opt.ns_flops = 0
            dist.barrier()
            w0 = process_bytes_written()
            t0 = time.perf_counter()
            opt.reduce_gradients()
            opt.step()
            dist.barrier()
            elapsed = time.perf_counter() - t0
            w1 = process_bytes_written()
            if run == 0:
                continue
            rec = out[placement]
            rec["times"].append(elapsed)
            rec["sent"].append(opt.stats.bytes_sent)
            rec["padding"].append(opt.stats.padding_bytes)
            rec["written"].append(None if w0 is None else w1 - w0)
            rec["ns"].append(opt.ns_flops)
            rec["phases"].append(dict(opt.phase_s))
    out["load_ratio"] = opts["owned"].load_ratio()
    out["total_bytes"] = sum(p.numel() * 4 for p in params.values())
    return out


PHASES = ("reduce", "update", "gather")


def rank0_medians(res: list[dict], placement: str) -> dict[str, float]:
    """Rank 0's median wall time of the whole phase (``optim``) and of each part, seconds."""
    rec = res[0][placement]
    return {"optim": statistics.median(rec["times"]),
            **{k: statistics.median(ph[k] for ph in rec["phases"]) for k in PHASES}}


def preset_phase(world: int, preset: str, runs: int) -> dict[str, dict[str, float]]:
    """The phase on flextrain's ``preset`` parameters at ``world``: ``rank0_medians`` per placement."""
    res = run_workers(_worker, world, 0, 0, runs, preset, timeout=600)
    return {placement: rank0_medians(res, placement) for placement in ("owned", "fsdp")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--flextrain-preset", default=None, help="flextrain's model of this preset (tiny, small, blocks) instead")
    args = ap.parse_args()
    if args.flextrain_preset:
        table, muon = preset_model(args.flextrain_preset)
        n_all = sum(math.prod(s) for s in table.values())
        n_muon = sum(math.prod(table[n]) for n in muon)
        print(f"optimizer phase: flextrain preset {args.flextrain_preset!r}: {len(muon)} Muon matrices "
              f"({n_muon / 1e6:.2f}M elements), AdamW on {len(table) - len(muon)} tensors "
              f"({(n_all - n_muon) / 1e6:.2f}M elements, {1 - n_muon / n_all:.1%}), gloo, 1 thread per rank, "
              f"median of {args.runs} runs (+1 warm-up), {os.cpu_count()} CPUs on this machine")
    else:
        total_mb = sum(a * b for a, b in shapes(args.layers, args.d).values()) * 4 / 2**20
        print(f"optimizer phase: {len(shapes(args.layers, args.d))} Muon matrices, {total_mb:.0f} MiB fp32, "
              f"d={args.d}, {args.layers} layers, gloo, 1 thread per rank, median of {args.runs} runs "
              f"(+1 warm-up), {os.cpu_count()} CPUs on this machine")
    header = (f"{'W':>2} {'placement':>9} {'time s':>8} {'sent MiB/rank':>14} {'written MiB/rank':>17} "
              f"{'NS GFLOP/rank':>14} {'NS balance':>10}")
    print(header)
    print("-" * len(header))
    summary = []
    for world in args.worlds:
        res = run_workers(_worker, world, args.layers, args.d, args.runs, args.flextrain_preset, timeout=600)
        row = {}
        for placement in ("owned", "fsdp"):
            med = rank0_medians(res, placement)
            t = med["optim"]
            sent = statistics.mean(statistics.median(r[placement]["sent"]) for r in res) / 2**20
            written = [r[placement]["written"] for r in res]
            wr = (statistics.mean(statistics.median(w) for w in written) / 2**20
                  if all(x is not None for w in written for x in w) else float("nan"))
            ns = max(statistics.median(r[placement]["ns"]) for r in res) / 1e9
            bal = f"{res[0]['load_ratio']:.3f}" if placement == "owned" else "-"
            print(f"{world:>2} {placement:>9} {t:>8.3f} {sent:>14.1f} {wr:>17.1f} {ns:>14.1f} {bal:>10}   "
                  + ", ".join(f"{k} {med[k]:.3f} s" for k in PHASES) + " (rank 0)")
            row[placement] = (t, sent, ns)
        summary.append((world, row))
    print()
    print(f"{'W':>2} {'time saved':>10} {'goal':>6} {'ceiling 1-1/W':>14} {'bytes owned/fsdp':>17} {'NS owned/fsdp':>14}")
    for world, row in summary:
        saved = 1 - row["owned"][0] / row["fsdp"][0]
        goal = {2: 0.45, 4: 0.60}.get(world)
        goal_s = f"{goal:.0%}" if goal else "-"
        print(f"{world:>2} {saved:>10.1%} {goal_s:>6} {1 - 1 / world:>14.1%} "
              f"{row['owned'][1] / row['fsdp'][1]:>17.3f} {row['owned'][2] / row['fsdp'][2]:>14.3f}")


if __name__ == "__main__":
    main()
