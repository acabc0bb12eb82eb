"""FSDP x TP state (issue 15): trainer wait per save and load time, flexckpt against DCP in
the same run.

    python3 dev.py bench tp_state [--layers 4] [--dim 512] [--saves 12] [--step-ms 200]

Four gloo ranks on a (fsdp 2, tp 2) mesh hold a model of ``--layers`` blocks parallelized as
torchtitan parallelizes them (``parallelize_module`` on the ``tp`` sub-mesh: q/k/v/w1/w3
``ColwiseParallel``, o/w2 ``RowwiseParallel``, norms ``SequenceParallel``; then
``fully_shard`` on the ``fsdp`` sub-mesh) and its AdamW state, as ``get_state_dict``
returns it: ``(_StridedShard(0, 2), Shard(0))``, ``(Shard(0), Shard(1))`` and ``(Shard(0),
Replicate())`` DTensors. Each library saves it ``--saves`` times, ``--step-ms`` apart (a
sleeping stand-in for the step). Trainer wait = time in ``save()`` plus the fence before the
optimizer may change the state (flexckpt ``wait_staged()``; DCP ``async_save`` with its
``DefaultStager``, waiting for the previous upload and for staging), the slowest rank.
Then each loads its last save into the same model laid out as (fsdp 4): seconds, slowest
rank, and the two loads must agree bit for bit.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from flexshard.spawn import run_workers  # noqa: E402


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.attn_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        for n in ("wq", "wk", "wv", "wo"):
            setattr(self, n, nn.Linear(dim, dim, bias=False))
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)


def build(layers: int, dim: int, mesh_shape: tuple, names: tuple, seed: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    torch.manual_seed(seed)
    model = nn.ModuleList([Block(dim, 3 * dim) for _ in range(layers)])
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    if "tp" in names:
        for block in model:
            plan = {n: ColwiseParallel() for n in ("wq", "wk", "wv", "w1", "w3")}
            plan.update({n: RowwiseParallel() for n in ("wo", "w2")})
            plan.update({n: SequenceParallel() for n in ("attn_norm", "ffn_norm")})
            parallelize_module(block, mesh["tp"], plan)
    for block in model:
        fully_shard(block, mesh=mesh["fsdp"])
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with torch.no_grad():
        for p in model.parameters():
            p.grad = p.detach().clone().mul_(0.5)
    optim.step()
    optim.zero_grad()
    return model, optim


def state_of(model, optim) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optim)
    return {"model": msd, "optim": osd}


def locals_of(state: dict) -> list[torch.Tensor]:
    out = []

    def visit(v):
        if isinstance(v, dict):
            for x in v.values():
                visit(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                visit(x)
        elif isinstance(v, torch.Tensor):
            out.append(v.to_local() if hasattr(v, "to_local") else v)

    visit(state)
    return out


def slowest(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def worker(rank: int, world: int, root: str, layers: int, dim: int, saves: int, step_s: float) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    from flexckpt import Checkpointer

    model, optim = build(layers, dim, (2, 2), ("fsdp", "tp"), 0)
    state = state_of(model, optim)
    nbytes = sum(t.numel() * t.element_size() for t in locals_of(state))
    out: dict = {"bytes": nbytes}
    # flexckpt
    ck = Checkpointer(f"{root}/flex", run_id="tp", keep_last=2, max_in_flight=1)
    waits = []
    for step in range(saves):
        time.sleep(step_s)
        dist.barrier()
        t0 = time.perf_counter()
        h = ck.save(step, state)
        h.wait_staged()
        waits.append(time.perf_counter() - t0)
    ck.wait()
    out["flexckpt"] = waits
    # DCP: async_save with its stager, at most one save in flight, its own group
    pg = dist.new_group(backend="gloo")
    stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False, use_async_staging=True,
                                          use_non_blocking_copy=False))
    waits, upload = [], None
    for step in range(saves):
        time.sleep(step_s)
        dist.barrier()
        t0 = time.perf_counter()
        if upload is not None:
            upload.result()
            if rank == 0 and step >= 3:
                shutil.rmtree(f"{root}/dcp/{step - 3}", ignore_errors=True)
        resp = dcp.async_save(state, checkpoint_id=f"{root}/dcp/{step}", process_group=pg, async_stager=stager)
        staging = getattr(resp, "staging_completion", None)
        if staging is not None:
            staging.result()
        upload = getattr(resp, "upload_completion", resp)
        waits.append(time.perf_counter() - t0)
    upload.result()
    stager.close()
    out["dcp"] = waits
    dist.barrier()
    # loads into (fsdp 4)
    mine, theirs = state_of(*build(layers, dim, (4,), ("fsdp",), 1)), state_of(*build(layers, dim, (4,), ("fsdp",), 1))
    dist.barrier()
    t0 = time.perf_counter()
    with Checkpointer(f"{root}/flex", run_id="load") as reader:
        reader.load(mine)
    out["flexckpt_load_s"] = slowest(time.perf_counter() - t0)
    dist.barrier()
    t0 = time.perf_counter()
    dcp.load(theirs, checkpoint_id=f"{root}/dcp/{saves - 1}", process_group=pg)
    out["dcp_load_s"] = slowest(time.perf_counter() - t0)
    out["agree"] = all(torch.equal(a, b) for a, b in zip(locals_of(mine), locals_of(theirs)))
    out["slowest_waits"] = {lib: [slowest(w) for w in out[lib]] for lib in ("flexckpt", "dcp")}
    ck.close()
    return out


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--saves", type=int, default=12)
    p.add_argument("--step-ms", type=float, default=200.0)
    p.add_argument("--dir", default=None)
    args = p.parse_args(argv)
    root = args.dir or tempfile.mkdtemp(prefix="flexckpt-tp-")
    try:
        res = run_workers(worker, 4, root, args.layers, args.dim, args.saves, args.step_ms / 1000, timeout=1800)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    r0 = res[0]
    print(f"# FSDP x TP state on (fsdp 2, tp 2), 4 gloo ranks: {r0['bytes'] / 2**20:.1f} MiB per rank, {args.saves} saves "
          f"{args.step_ms:.0f} ms apart; {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; loads agree: {r0['agree']}\n")
    print("| library | first save ms | p50 ms | p99 ms | load (fsdp 2, tp 2) -> (fsdp 4) s |")
    print("| --- | --- | --- | --- | --- |")
    for lib in ("dcp", "flexckpt"):
        w = [x * 1000 for x in r0["slowest_waits"][lib]]
        steady = w[1:] or w
        name = "DCP `async_save` + async stager" if lib == "dcp" else "flexckpt"
        print(f"| {name} | {w[0]:.1f} | {pct(steady, 0.5):.1f} | {pct(steady, 0.99):.1f} | {r0[lib + '_load_s']:.3f} |")
    f, d = r0["slowest_waits"]["flexckpt"][1:], r0["slowest_waits"]["dcp"][1:]
    if f and d:
        print(f"\nflexckpt / DCP: p99 {pct(f, 0.99) / pct(d, 0.99):.2f}, load {r0['flexckpt_load_s'] / r0['dcp_load_s']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
