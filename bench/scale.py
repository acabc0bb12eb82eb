"""flexckpt at 16,384 ranks, simulated on one machine (issue 10).

    python3 dev.py bench scale [--worlds 8 1024 16384] [--latency 0.03] [--inflight 64] [--page 1000]

The state: an 8B-like training state, built as structure only (no data): 32 layers of
q/k/v/o (4,096 x 4,096) and up/down/gate (16,384 x 4,096), each as param + exp_avg +
exp_avg_sq, 64 replicated norms (4,096) and a 128,256 x 4,096 embedding: 737 tensors, 26 G
fp32 elements. Two variants: ``block`` (``BlockShard(32)`` over all ranks) and ``hybrid``
(``HybridShard(64, 32)``: sharded in groups of 64, replicated across them). Lane cursors:
one ``ByLane`` entry of about 100 bytes per rank (L = W); one 5 kB ``PerRank`` value.
A third variant, ``tp``: FSDP x TP 8 x PP 4 as torchtitan lays it out (issue 15): the 32
layers in 4 pipeline stages of W/4 ranks, each stage a (fsdp W/32, tp 8) mesh of its own
ranks (``MeshLayout(offset=first rank of the stage)``); column-parallel q/k/v/up/gate
``(SS0:8, S0)``, row-parallel o/down ``(S0, S1)``, norms ``(S0, R)``, the embedding on
stage 0 ``(SS0:8, S0)``. (At W < 32 the degrees shrink: tp = min(8, W), pp = min(4, W / tp).)
Under PP each rank holds only its stage's tensors: its plan and first save use that stage's
structure, and rank 0 builds the union of the 4 stages' structures at commit (timed as
"union").

Measured per world size and variant:
- plan per rank: time and peak traced memory (tracemalloc) of the plan one rank builds
  (the replicated tensors' writers for everyone, then its own pieces, offsets and chunks);
- first ``save()`` of one rank, for the same 737 tensors at d=256 (ffn 1024), real
  ``Checkpointer`` in this process (storage ``memory://``), ranks 0 and W/2;
- manifest size (built by the coordinator's own code from W record lines), and its growth
  per added rank;
- load W -> W/2: metadata bytes one rank reads (manifest + the chunk tables of the files it
  reads) and the time to parse the manifest and compute its read plan's metadata;
- commit on a simulated object store (``--latency`` per request, ``--inflight`` requests in
  flight per client, listings paged at ``--page`` names): from the last rank's record to the
  committed manifest. All W records are written first; the group leaders (every 64th rank,
  each its own client) gather and write group records, then rank 0 gathers and commits. A
  sample of leaders is timed on the slow store (their work is the same); the rest run on
  the plain folder. Reported: leader time (max of the sample), rank 0's time, their sum.
  The "one reader" row is what a coordinator reading every record itself would take.
"""
from __future__ import annotations

import argparse
import gc
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import orjson
import torch

from flexckpt import ByLane, Checkpointer, PerRank, Storage
from flexckpt.format.chunktable import _HEADER
from flexckpt.format.manifest_parse import parse_manifest
from flexckpt.format.names import GROUP, group_name, record_name, step_dir
from flexckpt.format.write_plan import WritePlan, make_write_plan, part_of_world, sharded_loads
from flexckpt.catalog import committed_attempt
from flexckpt.save.commit import (
    build_manifest,
    check_fingerprints,
    commit,
    gather,
    lead_group,
    other_live_job,
    record_doc,
    wait_for,
)
from flexckpt.state.structure import TensorSpec
from flexshard import BlockShard, HybridShard, MeshLayout, Replicate, ShardedTensor, part_of

TODAY = {  # issue 10's measurements of c0aceba (make_write_plan on one rank), for the table
    8: "0.34 s", 512: "4.65 s", 2048: "8.70 s", 8192: "27.98 s",
}
CHUNK = 2 << 20
LANE_VALUE = {"doc": 123456789, "offset": 48213, "epoch": 2, "seed": "9f1c2e7a55b0d3c4", "emitted": 1048576, "w": 7}


def layer_shapes(d: int, ffn: int) -> list[tuple[str, tuple[int, int]]]:
    return [(n, (d, d)) for n in ("q", "k", "v", "o")] + [(n, (ffn, d)) for n in ("up", "down", "gate")]


def tp_degrees(world: int) -> tuple[int, int, int]:
    """(pp, fsdp, tp) of the ``tp`` variant at ``world``."""
    tp = min(8, world)
    pp = max(1, min(4, world // tp))
    return pp, world // (tp * pp), tp


def tp_structure(world: int, d: int, ffn: int, vocab: int) -> list[TensorSpec]:
    pp, fsdp, tp = tp_degrees(world)
    stage = world // pp

    def on(s: int, codes: tuple) -> MeshLayout:
        return MeshLayout((fsdp, tp), codes, offset=s * stage)

    col, row, norm = (f"SS0:{tp}", "S0"), ("S0", "S1"), ("S0", "R")
    specs = []
    for layer in range(32):
        s = layer * pp // 32
        for name, shape in layer_shapes(d, ffn):
            for kind in ("param", "exp_avg", "exp_avg_sq"):
                specs.append(TensorSpec(f"{kind}/layers.{layer}.{name}", torch.float32, shape,
                                        on(s, row if name in ("o", "down") else col)))
        for n in ("attn_norm", "ffn_norm"):
            specs.append(TensorSpec(f"param/layers.{layer}.{n}", torch.float32, (d,), on(s, norm)))
    specs.append(TensorSpec("param/embedding", torch.float32, (vocab, d), on(0, col)))
    return specs


def own_stage(specs: list[TensorSpec], world: int, rank: int) -> list[TensorSpec]:
    """The tensors rank ``rank`` holds under PP: those of its stage's meshes (and any on the
    whole world)."""
    return [s for s in specs if not part_of_world(s.layout, world) or s.layout.coordinate(rank) is not None]


def union_cost(world: int) -> tuple[float, int]:
    """Rank 0's union of the ``tp`` variant's stage structures (one per stage, as the records
    carry them), checked, and the union's plan with rank 0's part: seconds, tensors."""
    from flexckpt.save.stage_union import union_structure
    from flexckpt.state.structure import fingerprint
    specs = structure(world, "tp")
    pp, _fsdp, _tp = tp_degrees(world)
    per = world // pp
    stages = []
    for s in range(pp):
        mine = own_stage(specs, world, s * per)
        stages.append({"tensors": sorted((t.to_json() for t in mine), key=lambda d: d["name"]),
                       "plain": ["step"], "lanes": [], "per_rank": []})
    fps = [fingerprint(st) for st in stages]
    entries = {r: [fps[r // per]] for r in range(world)}
    gc.collect()
    t0 = time.perf_counter()
    union = union_structure(entries, 1, fps[0], stages[0], dict(zip(fps, stages)), world)
    specs_u = specs if union is None else union[0]  # one stage: no union to build
    plan = WritePlan(specs_u, world, make_write_plan([], world, CHUNK).rules)
    plan.rank_plan(0)
    return time.perf_counter() - t0, len(specs_u)


def structure(world: int, variant: str, d: int = 4096, ffn: int = 16384, vocab: int = 128256) -> list[TensorSpec]:
    if variant == "tp":
        return tp_structure(world, d, ffn, vocab)
    layout = BlockShard(32) if variant == "block" else HybridShard(min(64, world), 32)
    specs = []
    for layer in range(32):
        for name, shape in layer_shapes(d, ffn):
            for kind in ("param", "exp_avg", "exp_avg_sq"):
                specs.append(TensorSpec(f"{kind}/layers.{layer}.{name}", torch.float32, shape, layout))
        for norm in ("attn_norm", "ffn_norm"):
            specs.append(TensorSpec(f"param/layers.{layer}.{norm}", torch.float32, (d,), Replicate()))
    specs.append(TensorSpec("param/embedding", torch.float32, (vocab, d), layout))
    assert len(specs) == 737
    return specs


# -- plan per rank ---------------------------------------------------------------------------
def write_balance(world: int, variant: str) -> float:
    """Most bytes any rank writes, over the mean (total / W)."""
    from flexckpt.state.dtypes import itemsize
    plan = make_write_plan(structure(world, variant), world, CHUNK)
    loads = sharded_loads(plan.specs, world, plan.rules)
    for i, r in plan.replicated_writer.items():
        loads[r] += plan.specs[i].numel * itemsize(plan.specs[i].dtype)
    from flexckpt.format.write_plan import _mesh_loads
    for spec, geo in zip(plan.specs, plan._geometry):  # a stage's tensors: left out of the balancer's loads
        if part_of_world(spec.layout, world):
            np.add.at(loads, *_mesh_loads(spec.layout, spec.shape, geo.first, geo.replicas, itemsize(spec.dtype)))
    return float(loads.max() / loads.mean())


def plan_cost(world: int, variant: str, rank: int) -> tuple[float, float, int]:
    specs = structure(world, variant)
    if variant == "tp":  # under PP a rank knows its own stage's tensors only
        specs = own_stage(specs, world, rank)
    gc.collect()
    tracemalloc.start()
    t0 = time.perf_counter()
    plan = make_write_plan(specs, world, CHUNK)
    rp = plan.rank_plan(rank)
    dt = time.perf_counter() - t0
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return dt, peak / 2**20, len(rp.chunks)


def first_save(world: int, variant: str, rank: int, root: str) -> float:
    """Seconds inside the first ``save()`` of rank ``rank`` of ``world`` (walk, plan, queue);
    the copy and the write run behind it, and its commit is not awaited."""
    specs = structure(world, variant, d=256, ffn=1024)
    if variant == "tp":  # under PP a rank holds its own stage's tensors only
        specs = own_stage(specs, world, rank)
    state: dict = {"data": ByLane({str(rank): LANE_VALUE}), "rng": PerRank({"state": "x" * 5000}), "step": 1}
    for s in specs:
        state[s.name] = (torch.zeros(s.shape) if isinstance(s.layout, Replicate)
                         else ShardedTensor.empty(s.shape, s.layout, rank=rank, world_size=world))
    folder = os.path.join(root, f"save-{world}-{variant}-{rank}")
    ck = Checkpointer(folder, rank=rank, world_size=world, run_id="sim", commit_timeout=0.1, fsync=False, exit_timeout=5)
    gc.collect()
    h = ck.save(1, state)
    dt = h.save_seconds
    h.wait_staged(60)
    ck.close(timeout=10)
    shutil.rmtree(folder, ignore_errors=True)
    return dt


# -- manifest --------------------------------------------------------------------------------
def manifest_bytes(world: int, variant: str) -> tuple[bytes, WritePlan]:
    specs = structure(world, variant)
    plan = make_write_plan(specs, world, CHUNK)
    entries = {r: ["f" * 32, f"{r:016x}", 6000, 1 << 30, f"{r:016x}", 5100] for r in range(world)}
    lanes = {"data": {str(lane): LANE_VALUE for lane in range(world)}}
    m = build_manifest(step=1000, run_id="job", attempt="job.0123abcd.1", plan=plan, fingerprint="f" * 32, codec="none",
                       entries=entries, plain={"step": 1000, "lr": 3e-4}, lanes=lanes, per_rank_keys=["rng"])
    return m.to_bytes(), plan


def load_metadata(data: bytes, save_world: int, variant: str, rank: int) -> tuple[int, float, int]:
    """Bytes of metadata rank ``rank`` of world save_world/2 reads, and the time to parse the
    manifest and resolve its targets to files and chunks (the table bytes are computed from
    the plan: header + attempt + 16 bytes a chunk; per-rank values are not read at another
    world size)."""
    load_world = save_world // 2
    t0 = time.perf_counter()
    m = parse_manifest(data)
    target = structure(load_world, variant)
    writers: set[int] = set()
    for spec in target:
        rng = part_of(spec.layout, spec.shape, load_world, rank)
        if len(rng):
            for p in m.tensors[spec.name].pieces_in(rng):
                writers.add(int(p.file.rsplit("/r", 1)[1].split(".")[0]))
    plan = m.files.plan  # type: ignore[attr-defined]
    tables = sum(_HEADER.size + len(m.attempt) + 16 * len(plan.rank_plan(q).chunks) for q in writers)
    return len(data) + tables, time.perf_counter() - t0, len(writers)


# -- commit on a simulated object store ------------------------------------------------------
class SlowStorage(Storage):
    """A local folder that answers like an object store: ``latency`` seconds per request,
    at most ``inflight`` requests at once (per client: per instance), listings paged."""

    def __init__(self, url: str, latency: float, inflight: int, page: int) -> None:
        super().__init__(url)
        self.parallel_reads = True  # it answers like an object store
        self.latency, self.page = latency, page
        self._gate = threading.Semaphore(inflight)
        self.requests = 0
        self._lock = threading.Lock()

    def _request(self) -> None:
        with self._gate:
            with self._lock:
                self.requests += 1
            time.sleep(self.latency)

    def list_names(self, rel: str = "") -> list[str]:
        names = super().list_names(rel)
        for _ in range(max(1, -(-len(names) // self.page))):  # pages come one after the other
            self._request()
        return names

    def read_bytes(self, rel: str, limit: int | None = None) -> bytes:
        self._request()
        return super().read_bytes(rel, None)

    def put_atomic(self, rel: str, data: bytes, fsync: bool = True) -> None:
        self._request()
        super().put_atomic(rel, data, fsync=False)

    def exists(self, rel: str) -> bool:
        self._request()
        return super().exists(rel)

    def age(self, rel: str) -> float | None:
        self._request()
        return super().age(rel)

    def makedirs(self, rel: str) -> None:  # an object store has no folders
        super().makedirs(rel)


def commit_time(world: int, variant: str, root: str, args: argparse.Namespace) -> dict:
    attempt, step = "job.0123abcd.1", 1000
    shutil.rmtree(root, ignore_errors=True)
    fast = Storage(root)
    specs = structure(world, variant)
    plan = make_write_plan(specs, world, CHUNK)

    def own(r: int) -> bytes:
        return record_doc(run_id="job", attempt=attempt, step=step, world_size=world,
                          entries={r: ["f" * 32, f"{r:016x}", 6000, 1 << 20, f"{r:016x}", 5100]},
                          lanes={"data": {str(r): LANE_VALUE}})

    for g in range(-(-world // GROUP)):
        fast.makedirs(f"{step_dir(step)}/{attempt}/rec/g{g:05d}")
    fast.makedirs(f"{step_dir(step)}/{attempt}/grp")
    for r in range(world):
        if r % GROUP:
            with open(fast.path(f"{step_dir(step)}/{record_name(attempt, r)}"), "wb") as f:
                f.write(own(r))
    slow = lambda: SlowStorage(root, args.latency, args.inflight, args.page)  # noqa: E731

    def lead(g: int, storage: Storage) -> float:
        t0 = time.perf_counter()
        doc = lead_group(storage, step=step, run_id="job", attempt=attempt, world_size=world, rank=g * GROUP,
                         own=own(g * GROUP), timeout=120, max_delay=0.1)
        storage.put_atomic(f"{step_dir(step)}/{group_name(attempt, g)}", doc, fsync=False)
        return time.perf_counter() - t0

    groups = list(range(1, -(-world // GROUP)))
    sample = groups[:: max(1, len(groups) // args.leader_sample)][: args.leader_sample]
    with ThreadPoolExecutor(max_workers=4) as pool:  # the others, on the plain folder
        list(pool.map(lambda g: lead(g, fast), [g for g in groups if g not in sample]))
    leader_s = 0.0
    if sample:
        with ThreadPoolExecutor(max_workers=len(sample)) as pool:
            leader_s = max(pool.map(lambda g: lead(g, slow()), sample))
    coordinator = slow()
    t0 = time.perf_counter()
    entries, lanes = gather(coordinator, step=step, run_id="job", attempt=attempt, world_size=world, own=own(0),
                            timeout=120, max_delay=0.1)
    check_fingerprints(entries, step, "f" * 32, {}, {})
    assert other_live_job(coordinator, attempt, time.time() - 3600, step, set()) is None
    m = build_manifest(step=step, run_id="job", attempt=attempt, plan=plan, fingerprint="f" * 32, codec="none",
                       entries=entries, plain={"step": step}, lanes=lanes, per_rank_keys=["rng"])
    commit(coordinator, m, fsync=False)
    assert committed_attempt(coordinator, step) == attempt
    rank0_s = time.perf_counter() - t0
    out = {"leader_s": leader_s, "rank0_s": rank0_s, "total_s": leader_s + rank0_s, "rank0_requests": coordinator.requests}
    # today's shape: one reader lists and reads every record
    flat = slow()
    folder = f"{step_dir(step)}/{attempt}/flat"
    fast.makedirs(folder)
    for r in range(1, world):
        os.link(fast.path(f"{step_dir(step)}/{record_name(attempt, r)}") if r % GROUP else fast.path(
            f"{step_dir(step)}/{record_name(attempt, 1)}"), fast.path(f"{folder}/r{r:05d}.json"))
    t0 = time.perf_counter()
    wait_for(flat, folder, {f"r{r:05d}.json": r for r in range(1, world)}, 120, 0.1, "record")
    out["one_reader_s"] = time.perf_counter() - t0
    out["one_reader_requests"] = flat.requests
    return out


def real_save(world: int, root: str, args: argparse.Namespace) -> dict:
    """W emulated ranks (a real Checkpointer each, rank/world given) save a small state with
    the same 737 names (64 x 16 pieces) through the simulated store, each rank its own
    client: seconds from the last rank's record to the committed manifest, and in all."""
    specs = [TensorSpec(s.name, s.dtype, (64, 16) if len(s.shape) == 2 else (16,), s.layout if isinstance(s.layout, Replicate)
                        else BlockShard(4)) for s in structure(world, "block")]
    folder = os.path.join(root, f"real-{world}")
    cks = []
    for r in range(world):
        ck = Checkpointer(folder, rank=r, world_size=world, run_id="real", fsync=False, commit_timeout=120, stage_delay=0)
        ck.storage = SlowStorage(folder, args.latency, args.inflight, args.page)
        cks.append(ck)
    states = []
    for r in range(world):
        st: dict = {"data": ByLane({str(r): LANE_VALUE}), "rng": PerRank({"state": "x" * 5000})}
        for s in specs:
            st[s.name] = torch.zeros(s.shape) if isinstance(s.layout, Replicate) else \
                ShardedTensor.empty(s.shape, s.layout, rank=r, world_size=world)
        states.append(st)
    t0 = time.perf_counter()
    hs = [ck.save(1, st) for ck, st in zip(cks, states)]
    others = [h for r, h in enumerate(hs) if r % GROUP]
    for h in others:
        h._done.wait(300)  # its record is written
    last_record = time.perf_counter()
    hs[0]._done.wait(300)
    committed = time.perf_counter()
    ok = hs[0].exception() is None
    for ck in cks:
        ck.close(timeout=30)
    shutil.rmtree(folder, ignore_errors=True)
    return {"ok": ok, "after_last_record_s": committed - last_record, "total_s": committed - t0}


def fit(xs: list[int], ys: list[float]) -> str:
    a, b = np.polyfit(np.array(xs, dtype=float), np.array(ys, dtype=float), 1)
    return f"{b:,.0f} + {a:,.1f} x W"


def main() -> int:
    logging.getLogger("flexckpt").setLevel(logging.CRITICAL)  # first_save's commits time out on purpose
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", type=int, nargs="+", default=[8, 1024, 16384])
    p.add_argument("--variants", nargs="+", default=["block", "hybrid", "tp"], choices=["block", "hybrid", "tp"])
    p.add_argument("--latency", type=float, default=0.03, help="seconds per request of the simulated store (0.03)")
    p.add_argument("--inflight", type=int, default=64, help="requests in flight per client (64)")
    p.add_argument("--page", type=int, default=1000, help="names per listing request (1000)")
    p.add_argument("--leader-sample", type=int, default=8, help="group leaders timed on the slow store (8)")
    p.add_argument("--real", type=int, nargs="*", default=[8, 128], help="W of the end-to-end saves of emulated ranks (8 128)")
    p.add_argument("--dir", default=None, help="scratch folder (default: a temporary one)")
    args = p.parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="flexckpt-scale-")
    print(f"# flexckpt at scale (simulated): store {args.latency * 1000:.0f} ms/request, {args.inflight} in flight, "
          f"{args.page} names per listing page; {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}\n")
    rows = []
    try:
        for variant in args.variants:
            sizes = {}
            for world in args.worlds:
                mid = world // 2 + 3 if world > 8 else world - 1
                t0, mem0, chunks0 = plan_cost(world, variant, 0)
                t1, mem1, _ = plan_cost(world, variant, mid)
                s0, s1 = first_save(world, variant, 0, root), first_save(world, variant, mid, root)
                data, _plan = manifest_bytes(world, variant)
                sizes[world] = len(data)
                meta = [load_metadata(data, world, variant, r) for r in sorted({0, max(0, world // 4 - 1)})] if world >= 2 else []
                c = commit_time(world, variant, os.path.join(root, f"c{world}"), args)
                if variant == "tp":
                    ut, un = union_cost(world)
                    print(f"tp     W={world:>6}: union of {tp_degrees(world)[0]} stage structures ({un} tensors) "
                          f"and its plan at rank 0: {ut:.3f} s", flush=True)
                rows.append((variant, world, max(t0, t1), max(mem0, mem1), write_balance(world, variant), s0, s1, len(data), meta, c))
                r = rows[-1]
                print(f"{variant:6s} W={world:>6}: plan {r[2]:.3f} s / {r[3]:.1f} MiB (rank 0: {chunks0} chunks); "
                      f"first save() {s0 * 1000:.1f} ms (rank 0), {s1 * 1000:.1f} ms (rank {mid}); manifest {len(data) / 1e6:.3f} MB; "
                      f"load metadata {[f'{b / 1e6:.3f} MB / {t:.2f} s / {n} files' for b, t, n in meta]}; commit {c}",
                      flush=True)
            if len(sizes) > 1:
                print(f"{variant}: manifest bytes = {fit(list(sizes), list(sizes.values()))}")
        print()
        for world in args.real:
            res = real_save(world, root, args)
            print(f"end-to-end save, {world} emulated ranks (real Checkpointers, each its own client of the simulated store): "
                  f"committed {'ok' if res['ok'] else 'FAILED'}, {res['after_last_record_s']:.2f} s after the last record, "
                  f"{res['total_s']:.2f} s in all", flush=True)
        print()
        print("| variant | W | plan per rank: s (today) | plan peak MiB | busiest writer / mean | first save() ms, rank 0 / mid "
              "| manifest MB | load W->W/2: metadata MB per rank / parse s | commit: leaders + rank 0 = s (one reader s) "
              "| rank 0 requests (one reader) |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for variant, world, t, mem, balance, s0, s1, size, meta, c in rows:
            today = TODAY.get(world, "-") if variant == "block" else "-"
            m = max(meta, default=None)
            mtxt = f"{m[0] / 1e6:.3f} / {max(x[1] for x in meta):.2f}" if m else "-"
            print(f"| {variant} | {world:,} | {t:.3f} ({today}) | {mem:.1f} | {balance:.2f} | {s0 * 1000:.1f} / {s1 * 1000:.1f} | {size / 1e6:.3f} "
                  f"| {mtxt} | {c['leader_s']:.2f} + {c['rank0_s']:.2f} = {c['total_s']:.2f} ({c['one_reader_s']:.2f}) "
                  f"| {c['rank0_requests']} ({c['one_reader_requests']}) |")
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
