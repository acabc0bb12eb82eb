"""Demo: save a sharded training state from 2 processes, restore it on 1 and on 4.

    python3 dev.py demo-checkpoint [--dir PATH] [--mb 8]

A demo of the flexckpt library, not part of it (it lives outside the package).

Each tensor gets a layout (Replicate, Shard(0), Owned, BlockShard); every rank saves its
own pieces with no collective; rank 0 commits the manifest; then a single process and a
4-process group each load it back into the layouts of *their* world and check every
element against the original global tensors.
"""
from __future__ import annotations

import argparse
import logging
import math
import os
import shutil
import tempfile
import time

import torch

from flexckpt import ByLane, Checkpointer, PerRank
from flexckpt.format.names import step_dir
from flexshard import BlockShard, Owned, Replicate, Shard, ShardedTensor, assign_owners
from flexshard.spawn import run_workers

LANES = 8


def model_shapes(mb: float) -> dict[str, tuple[tuple[int, ...], str]]:
    """A small decoder's tensors: name -> (shape, layout kind)."""
    d = max(64, int(math.sqrt(mb * (1 << 20) / 4 / 14)) // 32 * 32)
    shapes = {"embed": ((1000, d), "block"), "final_norm": ((d,), "replicate")}
    for i in range(2):
        shapes[f"layer{i}/attn_qkv"] = ((3 * d, d), "owned")
        shapes[f"layer{i}/attn_out"] = ((d, d), "owned")
        shapes[f"layer{i}/mlp_in"] = ((4 * d, d), "owned")
        shapes[f"layer{i}/mlp_out"] = ((d, 4 * d), "owned")
        shapes[f"layer{i}/norm"] = ((d,), "replicate")
        shapes[f"layer{i}/momentum_bias"] = ((4 * d + 1,), "shard")
    return shapes


SAVED_WORLD = 2


def layouts_for(shapes: dict, world: int) -> dict:
    owners = assign_owners({n: math.prod(s) for n, (s, k) in shapes.items() if k == "owned"}, world)
    pick = {"replicate": lambda n: Replicate(), "shard": lambda n: Shard(0),
            "block": lambda n: BlockShard(32), "owned": lambda n: Owned(owners[n])}
    return {n: pick[k](n) for n, (s, k) in shapes.items()}


def global_tensor(name: str, shape: tuple[int, ...], step: int) -> torch.Tensor:
    seed = sum(map(ord, name)) * 1000 + step
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def build_state(shapes: dict, rank: int, world: int, step: int) -> dict:
    lay = layouts_for(shapes, world)
    state: dict = {"model": {n: ShardedTensor.from_global(global_tensor(n, s, step), lay[n], rank, world) for n, (s, _) in shapes.items()}}
    per = LANES // world
    state["data"] = ByLane({str(l): {"document": 1000 * step + l, "epoch": 0} for l in range(rank * per, (rank + 1) * per)})
    state["rng"] = PerRank(torch.get_rng_state())
    state["step"] = step
    return state


def _quiet() -> None:
    # the demo reports what it does itself
    logging.getLogger("flexckpt").setLevel(logging.ERROR)


def _save(rank: int, world: int, url: str, shapes: dict) -> list[str]:
    _quiet()
    lines = []
    with Checkpointer(url, keep_last=2) as ckpt:
        for step in (100, 200):
            state = build_state(shapes, rank, world, step)
            handle = ckpt.save(step, state)
            handle.wait_staged()  # fence: the optimizer may now change the state
            handle.result()
            t = handle.timings
            lines.append(
                f"  rank {rank}/{world} saved step {step}: {t['bytes'] / 2**20:6.2f} MiB, trainer wait "
                f"{handle.trainer_wait * 1e3:6.2f} ms (stage {t['stage_s'] * 1e3:.2f} ms, write {t['write_s'] * 1e3:.1f} ms"
                + (f", commit {t['commit_s'] * 1e3:.1f} ms)" if "commit_s" in t else ")")
            )
    return lines


def _load(rank: int, world: int, url: str, shapes: dict) -> list[str]:
    _quiet()
    lay = layouts_for(shapes, world)
    target = {"model": {n: ShardedTensor.empty(s, lay[n], rank=rank, world_size=world) for n, (s, _) in shapes.items()},
              "data": ByLane(), "rng": PerRank(None), "step": 0}
    with Checkpointer(url) as ckpt:
        t0 = time.perf_counter()
        # per-rank values belong to the saving ranks: at another world size they are left out on purpose
        step = ckpt.load(target, exclude=() if world == SAVED_WORLD else ("rng",))
        dt = time.perf_counter() - t0
        stats = ckpt.last_load_stats
    wrong = [n for n, (s, _) in shapes.items()
             if not torch.equal(target["model"][n].local, ShardedTensor.from_global(global_tensor(n, s, step), lay[n], rank, world).local)]
    held = sum(target["model"][n].local.numel() * 4 for n in shapes)
    mine = sorted(n for n in shapes if target["model"][n].local.numel())
    lines = [
        f"  rank {rank}/{world} loaded step {step} in {dt * 1e3:.1f} ms: holds {held / 2**20:.2f} MiB "
        f"({len(mine)} of {len(shapes)} tensors), read {stats.bytes_read / 2**20:.2f} MiB in {stats.chunks} chunks "
        f"({stats.direct_chunks} straight into the target), "
        + ("all bit-identical" if not wrong else f"MISMATCH in {wrong}")
    ]
    if rank == 0:
        lines.append(f"  lanes after load: {len(target['data'].values)} of {LANES} (every rank gets the union); "
                     f"rng restored: {target['rng'].restored} (only at the saved world size; excluded here)")
    if wrong:
        raise SystemExit("\n".join(lines))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", help="checkpoint folder (default: a fresh temporary one, removed after)")
    parser.add_argument("--mb", type=float, default=8.0, help="approximate state size in MiB (default 8)")
    args = parser.parse_args(argv)
    root = args.dir or tempfile.mkdtemp(prefix="flexckpt-demo-")
    url = os.path.abspath(root)
    shapes = model_shapes(args.mb)
    total = sum(math.prod(s) * 4 for s, _ in shapes.values())
    print(f"flexckpt demo: {len(shapes)} tensors, {total / 2**20:.1f} MiB of fp32 state, checkpoints in {url}\n")
    try:
        print("1. save from 2 processes (gloo), steps 100 and 200, keep_last=2, no collectives:")
        layouts = layouts_for(shapes, 2)
        for n in list(shapes)[:4]:
            print(f"     {n:22s} {str(shapes[n][0]):14s} -> {layouts[n]}")
        print("     ...")
        for lines in run_workers(_save, SAVED_WORLD, url, shapes, timeout=300):
            print("\n".join(lines))
        print(f"   committed: {sorted(os.listdir(url))}; {step_dir(200)} holds {sorted(os.listdir(os.path.join(url, step_dir(200))))}\n")
        print("2. restore on 1 process (every layout collapses to the whole tensor):")
        print("\n".join(_load(0, 1, url, shapes)))
        print("\n3. restore on 4 processes (owners recomputed for 4 ranks, shards re-cut):")
        for lines in run_workers(_load, 4, url, shapes, timeout=300):
            print("\n".join(lines))
        print("\nok: the state saved by 2 ranks was restored bit-identically on 1 and on 4")
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
