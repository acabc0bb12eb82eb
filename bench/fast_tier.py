"""The fast tier against the persistent tier: recovery time after losing a node, and the
time each fast save takes to reach its partner node.

World W (default 2), every rank its own emulated node (a folder under ``--shm``), a
Shard(0) fp32 state of ``--mib`` MiB per rank (harness's synthetic model). The run saves
step 1 persistently (to a local folder) and steps 2..1+``--saves`` to the fast tier with
one copy on the next node, then dies (no close). Node 1 is lost and replaced by an empty
node; the job restarts at the same W:
  fast       - ``load()``: the fast tier (rank 1 fetches its files from node 0 over gloo);
  persistent - ``load(step=1)`` through a store model: ``--latency`` per request,
               ``--inflight`` requests at once, ``--gbps`` GB/s per rank (a request takes
               exactly latency + bytes / bandwidth; the real read from a local folder is
               counted inside that time).
Recovery time is from the start of ``load()`` to its return, on the slowest rank; every
loaded byte is checked against the state that was saved. Each tier's restart is repeated
``--repeat`` times, alternated, and the figures are medians; the gloo floor (rank 0 sends
rank 1 the same number of bytes in one message on the tier's group) is measured in each
fast restart, after its load, so the ratio to it is taken under the same load.

Issue 29's limit, in each fast restart: before its load, each rank reads its node's own
files of the step (plain reads; none on the replaced node); after it, rank 0 sends rank 1
the bytes the recovery fetched, as the tier's transport sends them (one gloo message per
range of at most ``flexckpt.load.pending.FETCH_BYTES``, all posted at once). The report gives
recovery / (bare transport + local read) per restart and its median (goal: <= 1.25);
``--json PATH`` writes the headline medians (``compare_revisions.py`` reads them).

    python3 dev.py bench fast_tier [--mib 256] [--world 2] [--saves 3] [--repeat 3] [--json PATH]
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness as H  # noqa: E402


def _state(specs, rank, world, version):
    from flexshard import Shard, ShardedTensor

    local = H.build_local_state(specs, rank, world, version)
    return local, {"model": {s.name: ShardedTensor(local[s.name], Shard(0), s.global_shape, rank, world) for s in specs},
                   "step": version}


def _tier(cfg, node):
    from flexckpt.tier import LocalTier

    return LocalTier(dir=os.path.join(cfg["shm"], node), replicas=1, keep_last=2, timeout=300,
                     lineage="bench", stale_after=0)


def save_worker(rank, world, cfg):
    from flexckpt import Checkpointer

    os.environ["FLEXCKPT_NODE"] = f"n{rank}"
    specs = H.state_specs(cfg["mib"], cfg["tensors"], world)
    ck = Checkpointer(cfg["store"], local=_tier(cfg, f"n{rank}"), fsync=False)
    _, state = _state(specs, rank, world, 1)
    ck.save(1, state).result(600)
    rows = []
    for step in range(2, 2 + cfg["saves"]):
        _, state = _state(specs, rank, world, step)
        t0 = time.perf_counter()
        h = ck.save_local(step, state)
        h.wait_staged()
        wait = time.perf_counter() - t0
        h.result(600)
        rows.append({"trainer_wait": wait, "total": time.perf_counter() - t0, **h.timings})
    # the copies of the last step must have landed before the "kill"
    from flexckpt.tier.inventory import scan

    last = 1 + cfg["saves"]
    want = {rank} | set(ck.tier.sources)
    while not {b.rank for b in scan(ck.tier.storage) if b.step == last} >= want:
        time.sleep(0.01)
    import torch.distributed as dist

    dist.barrier()
    atexit.unregister(ck._atexit)  # killed: no close
    return rows


def load_worker(rank, world, cfg, which):
    import torch

    from flexckpt import Checkpointer
    from flexckpt.storage import RangeReader, Storage

    nodes = ["n0", "n_new"]
    os.environ["FLEXCKPT_NODE"] = nodes[rank] if world == 2 else f"n{rank}"
    if which == "persistent":
        gate = threading.Semaphore(cfg["inflight"])
        wire = threading.Lock()  # this rank's bandwidth: one transfer at a time at --gbps
        orig_into, orig_scatter, orig_bytes = RangeReader.read_into, RangeReader.read_scatter, Storage.read_bytes

        def request(n, read):
            # the model's time exactly: a request's latency, then its bytes at the rank's
            # bandwidth, the real read (from a local folder) counted inside that time
            with gate:
                time.sleep(cfg["latency"])
                with wire:
                    t0 = time.perf_counter()
                    out = read()
                    time.sleep(max(0.0, n / (cfg["gbps"] * 1e9) - (time.perf_counter() - t0)))
                    return out

        def read_into(self, offset, out):
            return request(memoryview(out).nbytes, lambda: orig_into(self, offset, out))

        def read_scatter(self, offset, outs):
            return request(sum(memoryview(o).nbytes for o in outs), lambda: orig_scatter(self, offset, outs))

        def read_bytes(self, rel, limit=None):
            n = Storage.size(self, rel)
            return request(n, lambda: orig_bytes(self, rel, limit))

        RangeReader.read_into, RangeReader.read_scatter, Storage.read_bytes = read_into, read_scatter, read_bytes
        # a store reads a fetch in one request; only a local folder is read in groups of
        # chunks (load.READ_GROUP_BYTES), and this model's folder stands for a store
        H.flexckpt_module("load.pending").READ_GROUP_BYTES = 1 << 62
    specs = H.state_specs(cfg["mib"], cfg["tensors"], world)
    # the persistent restart without the tier: its load(step=1) would be a rollback, which sets
    # the tier's steps aside, and the next fast restart would find none
    tier = _tier(cfg, os.environ["FLEXCKPT_NODE"]) if which == "fast" else None
    ck = Checkpointer(cfg["store"], local=tier, read_threads=4)
    local, state = _state(specs, rank, world, 0)
    for t in local.values():
        t.zero_()
    profile = None
    if cfg["profile"] and which == "fast":
        import cProfile

        profile = cProfile.Profile()
        profile.enable()
    import torch.distributed as dist

    local_read = _local_read(os.path.join(cfg["shm"], os.environ["FLEXCKPT_NODE"]), 1 + cfg["saves"], rank) \
        if which == "fast" else 0.0
    dist.barrier()  # every rank starts load() together: the time is the load's, not the start-up's skew
    t0 = time.perf_counter()
    step = ck.load(state) if which == "fast" else ck.load(state, step=1)
    seconds = time.perf_counter() - t0
    if profile is not None:
        profile.disable()
        profile.dump_stats(os.path.join(cfg["profile"], f"fast-r{rank}.prof"))
    bad = H.mismatches(local, specs, rank, world, step)
    rec = ck.tier.last_recovery if which == "fast" else None
    atexit.unregister(ck._atexit)  # keep the tier for the next restart
    floor = _gloo_floor(rank, ck.tier.group, H.state_bytes(local)) if which == "fast" else 0.0
    transport = 0.0
    if which == "fast":  # the same bytes as the fetches brought, moved as the tier's transport moves them
        fetched = torch.tensor([rec.fetched_bytes if rec else 0], dtype=torch.int64)
        dist.all_reduce(fetched, op=dist.ReduceOp.MAX)
        transport = _transport(rank, ck.tier.group, int(fetched))
    return {"seconds": seconds, "step": step, "bad": bad, "source": rec.source if rec else "persistent",
            "fetched": rec.fetched_bytes if rec else 0, "timings": rec.timings if rec else {}, "floor": floor,
            "transport": transport, "local_read": local_read}


def _local_read(node_dir, step, rank):
    """Seconds to read this node's own files of ``step`` (saved rank ``rank``'s data, table
    and values: ``step-N/ATTEMPT/rNNNNN.*``) with plain reads into one buffer; 0 on a node
    that holds none (the replaced node)."""
    import glob

    paths = sorted(p for p in glob.glob(os.path.join(node_dir, "**", f"r{rank:05d}.*"), recursive=True)
                   if f"step-{step:012d}" in p and not p.endswith(".done"))
    buf = bytearray(max((os.path.getsize(p) for p in paths), default=0))
    mv = memoryview(buf)
    t0 = time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(mv):
                pass
    return time.perf_counter() - t0


def _transport(rank, group, nbytes):
    """The bare transport under a recovery: rank 0 sends rank 1 ``nbytes`` over the tier's
    gloo group as the tier sends a fetch, one message per range of at most FETCH_BYTES, all
    posted at once, received into buffers posted at once; seconds on the receiver."""
    import torch
    import torch.distributed as dist

    FETCH_BYTES = H.flexckpt_module("load.pending").FETCH_BYTES

    if rank > 1:
        return 0.0
    sizes = [min(FETCH_BYTES, nbytes - p) for p in range(0, nbytes, FETCH_BYTES)]
    bufs = [torch.ones(n, dtype=torch.uint8) if rank == 0 else torch.empty(n, dtype=torch.uint8) for n in sizes]
    dist.barrier(group=group)
    t0 = time.perf_counter()
    works = [(dist.isend if rank == 0 else dist.irecv)(b, 1 - rank, group=group) for b in bufs]
    for w in works:
        w.wait()
    return time.perf_counter() - t0


def _gloo_floor(rank, group, nbytes):
    """The transport alone: rank 0 sends rank 1 ``nbytes`` in one message over the tier's
    gloo group (the floor under a recovery that fetches a whole rank's state)."""
    import torch
    import torch.distributed as dist

    if rank > 1:
        return 0.0
    buf = torch.ones(nbytes, dtype=torch.uint8) if rank == 0 else torch.zeros(nbytes, dtype=torch.uint8)
    dist.barrier(group=group)
    t0 = time.perf_counter()
    (dist.isend if rank == 0 else dist.irecv)(buf, 1 - rank, group=group).wait()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=float, default=256, help="MiB of state per rank (256)")
    p.add_argument("--tensors", type=int, default=24)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--saves", type=int, default=3, help="fast saves timed (3)")
    p.add_argument("--latency", type=float, default=0.03, help="seconds per request of the store model (0.03)")
    p.add_argument("--inflight", type=int, default=64, help="requests in flight per rank (64)")
    p.add_argument("--gbps", type=float, default=0.2, help="GB/s per rank of the store model (0.2)")
    p.add_argument("--shm", default="/dev/shm", help="where the emulated nodes' folders go (/dev/shm)")
    p.add_argument("--repeat", type=int, default=3, help="restarts timed of each tier, alternated (3)")
    p.add_argument("--profile", default="", help="a folder: cProfile each rank's fast load into it")
    p.add_argument("--json", default="", help="also write the headline medians here (JSON; compare_revisions.py reads it)")
    args = p.parse_args(argv)
    from flexshard.spawn import run_workers

    base = tempfile.mkdtemp(prefix="fxtier-bench-", dir=args.shm)  # the store's real reads are as cheap as the tier's
    shm = tempfile.mkdtemp(prefix="fxtier-nodes-", dir=args.shm)
    cfg = {**vars(args), "store": os.path.join(base, "store"), "shm": shm}
    fast, persistent = [], []  # one list of rank results per repeat
    try:
        saves = run_workers(save_worker, args.world, cfg, timeout=1800, threads_per_rank=1)
        shutil.rmtree(os.path.join(shm, "n1"))  # node 1 lost; "n_new" replaces it
        for _ in range(args.repeat):  # alternated, so that both see the machine's load alike
            fast.append(run_workers(load_worker, args.world, cfg, "fast", timeout=1800))
            persistent.append(run_workers(load_worker, args.world, cfg, "persistent", timeout=1800))
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    fs = [max(r["seconds"] for r in run) for run in fast]
    ss = [max(r["seconds"] for r in run) for run in persistent]
    floors = [max(r["floor"] for r in run) for run in fast]
    ok = all(not r["bad"] for run in fast + persistent for r in run) and all(r["source"] == "tier" for run in fast for r in run)
    f, s, floor = H.median(fs), H.median(ss), H.median(floors)
    transports = [max(r["transport"] for r in run) for run in fast]
    reads = [max(r["local_read"] for r in run) for run in fast]
    limits = [a + b for a, b in zip(transports, reads)]
    ratios = [a / b for a, b in zip(fs, limits)]
    lim, ratio = H.median(limits), H.median(ratios)
    print(f"# fast tier vs persistent: world {args.world}, {args.mib:g} MiB a rank, store model "
          f"{args.latency * 1000:g} ms/request, {args.inflight} in flight, {args.gbps} GB/s a rank; "
          f"{args.repeat} restarts of each, alternated; load {H.load_line()}")
    print(H.markdown_table(
        ["recovery (slowest rank), median of restarts", "seconds", "GB/s a rank", "bytes fetched from a peer", "exact"],
        [["fast tier (node 1 lost)", f"{f:.3f}", f"{args.mib * H.MIB / f / 1e9:.2f}", max(r["fetched"] for r in fast[0]), ok],
         ["persistent (store model)", f"{s:.3f}", f"{args.mib * H.MIB / s / 1e9:.2f}", 0, ok],
         ["gloo floor: the same bytes in one isend, rank 0 -> 1", f"{floor:.3f}", f"{args.mib * H.MIB / floor / 1e9:.2f}", "", ""],
         ["ratio persistent / fast (per restart)", f"{s / f:.1f}x ({' / '.join(f'{b / a:.1f}' for a, b in zip(fs, ss))})",
          "", "", ""],
         ["ratio fast / gloo floor (per restart)", f"{f / floor:.2f}x ({' / '.join(f'{a / b:.2f}' for a, b in zip(fs, floors))})",
          "", "", ""],
         [f"limit: bare transport ({H.median(transports):.3f} s: the fetched bytes rank 0 -> 1 in messages of at most "
          f"{FETCH_MIB} MiB, as the tier sends them) + local read of the node's own files ({H.median(reads):.3f} s)",
          f"{lim:.3f}", "", "", ""],
         [f"ratio fast / limit (per restart; goal <= {LIMIT_GOAL})",
          f"**{ratio:.2f}x** ({' / '.join(f'{r:.2f}' for r in ratios)}; p99 {H.percentile(ratios, 99):.2f})",
          "", "", "met" if ratio <= LIMIT_GOAL else "**not met**"]]))
    phases = ("inventory_s", "plan_s", "post_s", "read_s", "wait_peer_s", "drain_s", "agree_s", "finish_s")
    print("\n" + H.markdown_table(
        ["fast recovery phase (s), median of restarts", *[f"rank {r}" for r in range(args.world)]],
        [[k, *[f"{H.median(run[r]['timings'].get(k, 0) for run in fast):.3f}" for r in range(args.world)]] for k in phases]
        + [["load() total", *[f"{H.median(run[r]['seconds'] for run in fast):.3f}" for r in range(args.world)]]]))
    rows = [r for rank in saves for r in rank]
    print()
    print(H.markdown_table(
        ["fast save (median over ranks and saves)", "seconds"],
        [[k, f"{H.median(r[k] for r in rows):.3f}"] for k in ("trainer_wait", "stage_s", "write_s", "replicate_s", "total")]))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "headline": {"fast recovery s": f, "persistent recovery s": s,
                                                        "fast/limit": ratio, "limit s": lim},
                       "fast": [[{k: v for k, v in r.items() if k != "timings"} for r in run] for run in fast],
                       "persistent": [[{k: v for k, v in r.items() if k != "timings"} for r in run] for run in persistent]},
                      fh, default=str)
    return 0 if ok else 1


FETCH_MIB = 16  # flexckpt.load.pending.FETCH_BYTES, in the report's words
LIMIT_GOAL = 1.25  # issue 29: recovery <= 1.25 x (bare transport + local read)


if __name__ == "__main__":
    raise SystemExit(main())
