"""Read once, fan out (issue 29): an HSDP state (replicate 2 x shard 2) saved at world 4 and
restored at world 4 through a store model, with fan-out (every stored byte read once by
one rank, sent to its replicas over gloo) against today's load (each replica reads its
shard itself).

    python3 dev.py bench restore_fanout [--mib 256] [--tensors 16] [--runs 3]
        [--latency 0.03] [--inflight 64] [--gbps 0.2] [--aggregate 0.4]

The store model: a local folder in ``/dev/shm`` whose every ranged read takes ``--latency``
seconds (``--inflight`` at once a rank), then its bytes at ``--gbps`` GB/s a rank (one
transfer at a time a rank) *and* within an aggregate ``--aggregate`` GB/s shared by all
ranks: each transfer reserves the next free stretch of the aggregate's time in a file all
ranks lock (``fcntl.flock``), and ends when both its rank's time and its reservation end
(the real read counted inside). Each run is one group of 4 fresh processes making the two
loads in turns, fan-out first in odd rounds; each load from a barrier to the end of its
``load()``, the slowest rank's; medians over runs. Every load goes into zeroed tensors and
is compared bit for bit with the saved values. Both loads read with 2 threads a rank, the
default for a remote store (this model is a local folder, whose default is 1 thread where
ranks outnumber the cores).
"""
from __future__ import annotations

import argparse
import fcntl
import os
import shutil
import struct
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness as H  # noqa: E402

WORLD = 4
HSDP = ((2, 2), ("R", "S0"))  # replicate 2 x shard 2


class AggregateLimit:
    """The store's aggregate bandwidth, shared by processes through a locked file holding
    the time (``time.monotonic``, one clock for every process) its next transfer may start."""

    def __init__(self, path: str, bytes_per_s: float) -> None:
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        self.rate = bytes_per_s

    def reserve(self, n: int) -> float:
        """When a transfer of ``n`` bytes asked for now ends."""
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        try:
            raw = os.pread(self.fd, 8, 0)
            free = struct.unpack("d", raw)[0] if len(raw) == 8 else 0.0
            end = max(time.monotonic(), free) + n / self.rate
            os.pwrite(self.fd, struct.pack("d", end), 0)
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        return end


def install_store_model(cfg: dict) -> None:
    from flexckpt.storage import RangeReader, Storage

    gate = threading.Semaphore(cfg["inflight"])
    wire = threading.Lock()  # this rank's bandwidth: one transfer at a time
    shared = AggregateLimit(cfg["limit_file"], cfg["aggregate"] * 1e9)

    def request(n, read):  # latency, then the bytes within this rank's and the store's bandwidth
        with gate:
            time.sleep(cfg["latency"])
            with wire:
                own_end = time.monotonic() + n / (cfg["gbps"] * 1e9)
                out = read()
                time.sleep(max(0.0, max(own_end, shared.reserve(n)) - time.monotonic()))
        return out

    def modelled(call, nbytes):  # ``call`` as one request of the model, of ``nbytes(*args)`` bytes
        return lambda *args, **kw: request(nbytes(*args, **kw), lambda: call(*args, **kw))

    RangeReader.read_into = modelled(RangeReader.read_into, lambda _, __, out: memoryview(out).nbytes)
    RangeReader.read_scatter = modelled(RangeReader.read_scatter,
                                        lambda _, __, outs: sum(memoryview(o).nbytes for o in outs))
    Storage.read_bytes = modelled(Storage.read_bytes, lambda self, rel, limit=None: Storage.size(self, rel))
    # a store answers a fetch in one request; only a local folder is read in groups of chunks
    import flexckpt.load.pending

    flexckpt.load.pending.READ_GROUP_BYTES = 1 << 62


def _specs(cfg: dict) -> list[tuple[str, tuple[int, int]]]:
    cols = 1024
    rows = max(4, int(cfg["mib"] * H.MIB / 4 / cols / cfg["tensors"]) // 4 * 4)
    return [(f"layer{i}.w", (rows, cols)) for i in range(cfg["tensors"])]


def _state(cfg: dict, rank: int, zero: bool) -> dict:
    import torch

    from flexshard import MeshLayout, ShardedTensor

    layout = MeshLayout(*HSDP)
    out = {}
    for i, (name, shape) in enumerate(_specs(cfg)):
        box = layout.box(shape, WORLD, rank)
        rows = torch.arange(box.offsets[0], box.offsets[0] + box.sizes[0], dtype=torch.float32)
        local = torch.zeros(box.sizes) if zero else (rows[:, None] * shape[1] + torch.arange(shape[1]) + i * 1e-3)
        out[name] = ShardedTensor(local.contiguous(), layout, shape, rank, WORLD)
    return out


def save_worker(rank: int, world: int, cfg: dict) -> None:
    from flexckpt import Checkpointer

    ck = Checkpointer(cfg["store"], fanout=False)
    ck.save(1, _state(cfg, rank, zero=False)).result(600)
    ck.close()


def load_worker(rank: int, world: int, cfg: dict) -> list[dict]:
    import torch
    import torch.distributed as dist

    from flexckpt import Checkpointer

    install_store_model(cfg)
    want = _state(cfg, rank, zero=False)
    rows = []
    for r in range(cfg["rounds"]):
        order = (True, False) if r % 2 else (False, True)
        for fan in order:
            # read_threads=2: what a load from a remote store takes by default (the model is a local
            # folder, for which the default drops to 1 where 4 ranks share 2 cores: load.fetch.read_threads_for)
            ck = Checkpointer(cfg["store"], fanout=fan, read_threads=2)
            state = _state(cfg, rank, zero=True)
            dist.barrier()
            t0 = time.perf_counter()
            ck.load(state, step=1)
            seconds = time.perf_counter() - t0
            s = ck.last_load_stats
            exact = all(torch.equal(state[k].local, want[k].local) for k in want)
            rows.append({"fanout": fan, "seconds": seconds, "store": s.bytes_from_store, "peers": s.bytes_from_peers,
                         "manifest_read": not s.manifest_from_peer, "exact": exact})
            ck.close()
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=float, default=256, help="MiB of state in all (stored once) (256)")
    p.add_argument("--tensors", type=int, default=16)
    p.add_argument("--runs", type=int, default=3, help="groups of fresh processes (3)")
    p.add_argument("--rounds", type=int, default=2, help="loads of each kind a run, alternated (2)")
    p.add_argument("--latency", type=float, default=0.03, help="seconds a request of the store model (0.03)")
    p.add_argument("--inflight", type=int, default=64, help="requests in flight a rank (64)")
    p.add_argument("--gbps", type=float, default=0.2, help="GB/s a rank of the store model (0.2)")
    p.add_argument("--aggregate", type=float, default=0.4, help="GB/s of the store for all ranks together (0.4)")
    args = p.parse_args(argv)
    from flexshard.spawn import run_workers

    base = tempfile.mkdtemp(prefix="fxfanout-bench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    cfg = {**vars(args), "store": os.path.join(base, "store"), "limit_file": os.path.join(base, "aggregate")}
    runs = []
    try:
        run_workers(save_worker, WORLD, cfg, timeout=900)
        for _ in range(args.runs):
            runs.append(run_workers(load_worker, WORLD, cfg, timeout=1800))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    rows = []
    times = {}
    for fan in (False, True):
        # a load's time: the slowest rank's; one figure per round of each run
        secs = [max(rank[i]["seconds"] for rank in run) for run in runs for i in range(len(run[0]))
                if run[0][i]["fanout"] == fan]
        per_rank = [[r for r in rank if r["fanout"] == fan][0] for rank in runs[0]]
        exact = all(r["exact"] for run in runs for rank in run for r in rank if r["fanout"] == fan)
        times[fan] = H.median(secs)
        rows.append(["fan-out (read once)" if fan else "today (each replica reads)", f"{times[fan]:.3f}",
                     " / ".join(f"{s:.2f}" for s in secs),
                     " / ".join(f"{r['store'] / H.MIB:.1f}" for r in per_rank),
                     " / ".join(f"{r['peers'] / H.MIB:.1f}" for r in per_rank),
                     f"{sum(r['store'] for r in per_rank) / H.MIB:.1f}", sum(r["manifest_read"] for r in per_rank), exact])
    ratio = times[True] / times[False]
    print(f"# restore with fan-out: HSDP (replicate 2 x shard 2) at world 4, {args.mib:g} MiB stored, store model "
          f"{args.latency * 1000:g} ms/request, {args.inflight} in flight, {args.gbps} GB/s a rank, {args.aggregate} "
          f"GB/s in all; {args.runs} runs x {args.rounds} rounds; load {H.load_line()}")
    print(H.markdown_table(["load", "seconds (median)", "each load", "MiB from store, rank 0/1/2/3",
                            "MiB from peers, rank 0/1/2/3", "MiB from store, all ranks",
                            "ranks that read the manifest", "exact"], rows))
    print(f"\nfan-out / today: {ratio:.2f}x (goal <= 0.60)")
    ok = all(r[-1] for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
