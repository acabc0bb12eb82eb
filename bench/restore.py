"""Restore benchmark: one state saved at world 2, loaded at world 2, 1 and 4 (resharding
when the world differs), flexckpt's ``Checkpointer.load`` against ``dcp.load``, from a
cold page cache (the checkpoint's files dropped with fadvise) and from a warm one.

    python3 dev.py bench restore [--mb-per-rank 50 [MB ...]] [--tensors 200] [--load-worlds 2 1 4]
        [--runs 3] [--loads 3] [--libs flexckpt dcp] [--read-threads N] [--dir PATH] [--out PATH]
    python3 dev.py bench restore --versus c0aceba [--runs 3] [--repeat 5]

``--versus REF`` is another mode (issue 18's "warm restore 2 -> 1, this format against
v1" row): the same state saved at world 2 by this tree's flexckpt and by the one at git
revision REF (``git archive`` of its ``src/``; c0aceba writes format 1), each loaded at
world 1 in one process, ``--repeat`` loads warm then ``--repeat`` cold, best wall and CPU
seconds; the two trees take turns, ``--runs`` rounds, each in a fresh process.

The state is the same as save_latency's (Shard(0) pieces of fp32 tensors; DTensors for
DCP, ShardedTensors for flexckpt), saved once by each library at world 2 (flexckpt
without compression). Each load goes into zeroed tensors of the target world's layout
and is checked element by element afterwards. Seconds are the slowest rank's, from a
barrier to the end of its load call (the state dict of DTensors or ShardedTensors is
built before the barrier, as a trainer holds it; until issue 29's fifth session it was
built inside the timed call: ~3 ms of the flexckpt figure); MiB/s is the whole state over
those seconds. The raw reference reads the flexckpt checkpoint's data files themselves, split into equal
byte ranges over the ranks, with pread into a buffer, cold and warm. Each run (fresh
rank processes per world) makes ``--loads`` rounds of the raw read and every library's
load, cold then warm; figures are medians over every round of every run (on a machine
shared with other work, rounds taken a second apart disturb each other less than runs).
``--libs flexckpt`` leaves dcp out (neither saved nor loaded; its columns read "-"): the
restore-against-raw rows in a third of the time.

Issue 29's limit: in the same rounds, each rank preads as many bytes of the data files as
its load read from the store (its ``bytes_read``, learnt by one untimed load first) and
runs flexckpt's checksum over them in chunk_bytes pieces (the fastest a verified load can
be); the report gives restore / (read + checksum), cold and warm, median and p99 over every
round (goal: <= 1.25). The JSON report's ``headline`` holds the medians
``compare_revisions.py`` compares.

Several sizes (``--mb-per-rank 25 100 400``) separate a load's fixed cost from its cost a
byte: each size is saved into its own folder and measured as above (its own rank processes,
the sizes taking turns within each run and world), the tables come once a size (the first
size's headline keys unchanged, the others' with the size in them), and a last table gives,
per load world and kind, the restore's and the limit's medians at every size and a
least-squares line through the sizes' medians, restore = F + r x limit (``fit_against_limit``):
F the fixed cost a load (plan, agreements, the wait for the slowest rank), r the ratio a
byte, and the smallest state at which the median ratio would be <= 1.25 under that line.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import sys
import tempfile
import time
from typing import Any, NamedTuple, Sequence

import harness as H

SAVE_WORLD = 2


def _quiet() -> None:
    logging.getLogger("flexckpt").setLevel(logging.ERROR)
    logging.getLogger().setLevel(logging.CRITICAL)  # DCP logs through the root logger
    import warnings

    warnings.filterwarnings("ignore")


def _dtensors(local: dict, specs: list, world: int) -> dict:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from peers import _contiguous_stride

    mesh = init_device_mesh("cpu", (world,))
    return {"model": {s.name: DTensor.from_local(local[s.name], mesh, [Shard(0)], run_check=False, shape=torch.Size(s.global_shape),
                                                 stride=_contiguous_stride(s.global_shape)) for s in specs}}


def _sharded(local: dict, specs: list, rank: int, world: int) -> dict:
    from flexshard import Shard, ShardedTensor

    return {"model": {s.name: ShardedTensor(local[s.name], Shard(0), s.global_shape, rank, world) for s in specs}}


CHUNK_BYTES = 2 << 20  # flexckpt's default chunk size, given explicitly: the limit's checksum pass hashes pieces of it


def save_worker(rank: int, world: int, cfg: dict, root: str) -> dict:
    import torch.distributed.checkpoint as dcp

    from flexckpt import Checkpointer

    _quiet()
    specs = H.state_specs(cfg["mb_per_rank"], cfg["tensors"], SAVE_WORLD)
    local = H.build_local_state(specs, rank, world, version=7)
    with Checkpointer(os.path.join(root, "flexckpt"), run_id="restore-bench", chunk_bytes=CHUNK_BYTES) as ckpt:
        ckpt.save(7, _sharded(local, specs, rank, world)).result()
    if not cfg.get("dcp", True) or "dcp" not in cfg.get("libs", ("dcp",)):
        return {"bytes": H.state_bytes(local)}
    dcp.save(_dtensors(local, specs, world), checkpoint_id=os.path.join(root, "dcp"))
    return {"bytes": H.state_bytes(local)}


def _files(folder: str) -> list[str]:
    out = []
    for d, _, names in os.walk(folder):
        out += [os.path.join(d, n) for n in names]
    return sorted(out)


def _drop_all(root: str) -> float:
    worst = 0.0
    for path in _files(root):
        H.drop_from_page_cache(path)
        worst = max(worst, H.resident_fraction(path))
    return worst


def load_worker(rank: int, world: int, cfg: dict, root: str, order: list[str]) -> dict:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from flexckpt import Checkpointer

    _quiet()
    specs = H.state_specs(cfg["mb_per_rank"], cfg["tensors"], SAVE_WORLD)
    target = {s.name: torch.zeros(H.piece_range(s, rank, world)[2]) for s in specs}
    extra = {} if cfg["read_threads"] is None else {"read_threads": cfg["read_threads"]}
    ckpt = Checkpointer(os.path.join(root, "flexckpt"), **extra)
    out: dict[str, Any] = {"resident": 0.0}

    def cold() -> None:
        dist.barrier()
        if rank == 0:
            out["resident"] = max(out["resident"], _drop_all(root))
        dist.barrier()

    # raw reference: the flexckpt data files, split into equal byte ranges over the ranks
    data = [p for p in _files(os.path.join(root, "flexckpt")) if p.endswith(".data")]
    sizes = [os.path.getsize(p) for p in data]
    total = sum(sizes)
    lo, hi = total * rank // world, total * (rank + 1) // world
    buf = torch.empty(hi - lo, dtype=torch.uint8)
    buf.fill_(0)

    def raw_read() -> float:
        mv = memoryview(buf.numpy())
        dist.barrier()
        t0 = time.perf_counter()
        _pread_spans(data, sizes, [(lo, hi)], mv)
        return time.perf_counter() - t0

    # the limit (issue 29): the bytes this rank's load reads (as many as its load's
    # bytes_read, from its share's start on), plain pread, then the library's checksum
    # over them in chunk_bytes pieces, as a load verifies them: the fastest a verified load can be
    state = _sharded(target, specs, rank, world)
    for t in target.values():
        t.zero_()  # its pages touched, as a trainer's initialized model's are (and every timed load's below)
    raw_read()  # every data file read once by the ranks together: warm (the save wrote past the page cache, O_DIRECT)
    dist.barrier()
    t0 = time.perf_counter()
    ckpt.load(state)  # learns bytes_read; timed apart: the first load of a process (first-use costs), warm
    out["first_warm"] = time.perf_counter() - t0
    # (bytes_read counts a values file's bytes too, a few KiB: the data files hold at most ``total``)
    n_load = min(ckpt.last_load_stats.bytes_read, total)
    spans = limit_spans(lo, n_load, total)
    lim = torch.zeros(n_load, dtype=torch.uint8)

    def limit_read() -> tuple[float, float]:
        mv = memoryview(lim.numpy())
        dist.barrier()
        t0 = time.perf_counter()
        _pread_spans(data, sizes, spans, mv)
        t1 = time.perf_counter()
        checksum_pass(mv, CHUNK_BYTES)
        return t1 - t0, time.perf_counter() - t1

    def load(lib: str) -> tuple[float, float, list[str], dict]:
        """Wall and CPU seconds (every thread of this rank's process) of one load, the
        tensors that came out wrong, flexckpt's load stats."""
        for t in target.values():
            t.zero_()
        # the state to load into, built before the clock starts (a trainer holds it already)
        state = _sharded(target, specs, rank, world) if lib == "flexckpt" else _dtensors(target, specs, world)
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        if lib == "flexckpt":
            ckpt.load(state)
            stats = vars(ckpt.last_load_stats).copy() if ckpt.last_load_stats else {}
        else:
            dcp.load(state, checkpoint_id=os.path.join(root, "dcp"))
            stats = {}
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        return seconds, cpu, H.mismatches(target, specs, rank, world, version=7), stats

    # ``loads`` rounds, each the raw read and every library's load, cold then warm: the
    # rounds' figures are paired (taken within a second of each other), and lists
    for k in ("raw_cold", "raw_warm", *LIMIT_KEYS,
              *(f"{lib}_{kind}" for lib in order for kind in ("cold", "warm", "cpu_cold", "cpu_warm"))):
        out[k] = []
    for i in range(cfg.get("loads", 1)):
        cold()
        out["raw_cold"].append(raw_read())
        out["raw_warm"].append(raw_read())
        cold()
        for kind in ("cold", "warm"):
            read_s, sum_s = limit_read()
            out[f"lim_read_{kind}"].append(read_s)
            out[f"lim_sum_{kind}"].append(sum_s)
            out[f"lim_{kind}"].append(read_s + sum_s)
        for lib in (order if i % 2 == 0 else order[::-1]):
            cold()
            seconds, cpu, bad_c, out[f"{lib}_stats"] = load(lib)
            out[f"{lib}_cold"].append(seconds)
            out[f"{lib}_cpu_cold"].append(cpu)
            seconds, cpu, bad_w, warm_stats = load(lib)
            for ph in PHASES if lib == "flexckpt" else ():  # where a warm load's time went (LoadStats' seconds)
                out.setdefault(f"{ph}_warm", []).append(warm_stats.get(ph, math.nan))
            out[f"{lib}_warm"].append(seconds)
            out[f"{lib}_cpu_warm"].append(cpu)
            out[f"{lib}_bad"] = sorted(set(out.get(f"{lib}_bad", []) + bad_c + bad_w))[:5]
    ckpt.close()
    out["total"] = total
    out["limit_bytes"] = n_load
    return out


PHASES = ("plan_s", "fetch_s", "agree_s", "apply_s")
LIMIT_KEYS = tuple(f"lim{part}_{kind}" for part in ("", "_read", "_sum") for kind in ("cold", "warm"))


def limit_spans(start: int, n: int, total: int) -> list[tuple[int, int]]:
    """``n`` bytes of the data files (``total`` bytes end to end) from ``start`` on, wrapping
    round to the first file's start: at most two ``(lo, hi)`` spans."""
    if not 0 <= n <= total or not 0 <= start <= total:
        raise ValueError(f"{n} bytes from byte {start} of {total}: both must lie in [0, {total}]")
    start %= max(total, 1)
    first = min(n, total - start)
    return [(start, start + first)] + ([(0, n - first)] if n > first else [])


def checksum_pass(mv: memoryview, chunk_bytes: int) -> None:
    """flexckpt's checksum over ``mv`` in ``chunk_bytes`` pieces (a load hashes each chunk alone)."""
    checksum_int = H.flexckpt_module("format.checksum").checksum_int

    for p in range(0, len(mv), chunk_bytes):
        checksum_int(mv[p : p + chunk_bytes])


def _pread_spans(paths: list[str], sizes: list[int], spans: list[tuple[int, int]], mv: memoryview) -> None:
    """pread the byte ranges ``spans`` of ``paths`` (end to end, of ``sizes``) into ``mv``, in order."""
    got = 0
    for lo, hi in spans:
        pos = 0
        for path, size in zip(paths, sizes):
            a, b = max(lo, pos), min(hi, pos + size)
            if a < b:
                fd = os.open(path, os.O_RDONLY)
                try:
                    done = 0
                    while done < b - a:
                        k = os.preadv(fd, [mv[got + done : got + (b - a)]], a - pos + done)
                        if k == 0:
                            raise EOFError(path)
                        done += k
                finally:
                    os.close(fd)
                got += b - a
            pos += size


def _one_process(root: str, cfg: dict, repeat: int) -> dict:
    """Save (once per ``root``) at world 2, then load at world 1 in this process: best wall
    and CPU seconds of ``repeat`` warm loads, then of ``repeat`` cold ones."""
    import torch

    from flexckpt import Checkpointer
    from flexshard.spawn import run_workers

    _quiet()
    if not os.path.isdir(os.path.join(root, "flexckpt")):
        run_workers(save_worker, SAVE_WORLD, dict(cfg, dcp=False), root, timeout=600)
    specs = H.state_specs(cfg["mb_per_rank"], cfg["tensors"], SAVE_WORLD)
    target = {s.name: torch.zeros(H.piece_range(s, 0, 1)[2]) for s in specs}
    state = _sharded(target, specs, 0, 1)
    out: dict[str, Any] = {}
    with Checkpointer(os.path.join(root, "flexckpt")) as ckpt:
        ckpt.load(state)  # imports and first-use caches, as in a process that loads once
        for kind in ("warm", "cold"):
            walls, cpus = [], []
            for _ in range(repeat):
                for t in target.values():
                    t.zero_()
                if kind == "cold":
                    _drop_all(root)
                t0, c0 = time.perf_counter(), time.process_time()
                ckpt.load(state)
                walls.append(time.perf_counter() - t0)
                cpus.append(time.process_time() - c0)
            out[kind] = [min(walls), min(cpus)]
    out["bad"] = H.mismatches(target, specs, 0, 1, version=7)[:5]
    return out


def versus(args: argparse.Namespace, cfg: dict) -> int:
    """This tree against git revision ``args.versus``, 2 -> 1 in one process (see the module doc)."""
    import subprocess

    here = os.path.dirname(os.path.abspath(__file__))
    repo = os.path.dirname(here)
    root = args.dir or tempfile.mkdtemp(prefix="flexckpt-restore-versus-")
    old_src = os.path.join(root, "src-" + args.versus)
    if not os.path.isdir(old_src):
        os.makedirs(old_src)
        tar = subprocess.run(["git", "-C", repo, "archive", args.versus, "src"], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", old_src], input=tar, check=True)
    trees = {"this": os.path.join(repo, "src"), args.versus: os.path.join(old_src, "src")}
    rows, best = [], {name: {"warm": [1e9, 1e9], "cold": [1e9, 1e9]} for name in trees}
    any_bad = False
    try:
        for run in range(args.runs):
            got = {}
            for name in (list(trees) if run % 2 == 0 else list(trees)[::-1]):
                env = dict(os.environ, PYTHONPATH=os.pathsep.join([trees[name], here]))
                cmd = [sys.executable, os.path.abspath(__file__), "--one-process", os.path.join(root, name),
                       "--mb-per-rank", str(cfg["mb_per_rank"]), "--tensors", str(args.tensors), "--repeat", str(args.repeat)]
                done = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, timeout=900)
                got[name] = json.loads(done.stdout.strip().splitlines()[-1])
                any_bad |= bool(got[name]["bad"])
                for kind in ("warm", "cold"):
                    best[name][kind] = [min(a, b) for a, b in zip(best[name][kind], got[name][kind])]
            this, old = got["this"], got[args.versus]
            rows.append([f"{run + 1}", H.load_line()] + [
                f"{this[k][0] * 1e3:.0f} / {this[k][1] * 1e3:.0f} vs {old[k][0] * 1e3:.0f} / {old[k][1] * 1e3:.0f} "
                f"({this[k][0] / old[k][0]:.2f}x / {this[k][1] / old[k][1]:.2f}x)" for k in ("warm", "cold")])
            print(f"round {run + 1}: {rows[-1]}", file=sys.stderr, flush=True)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    b, o = best["this"], best[args.versus]
    text = "\n".join([
        f"## Restore 2 -> 1 in one process: this tree against {args.versus}",
        "",
        f"State: {cfg['mb_per_rank'] * SAVE_WORLD:.0f} MiB in {args.tensors} tensors saved at world 2 by each tree, loaded at "
        f"world 1; per round, the best of {args.repeat} warm loads then of {args.repeat} cold ones (ms wall / CPU), "
        f"this tree vs {args.versus}; each round a fresh process per tree.",
        "",
        H.markdown_table(["round", "load average", "warm", "cold"], rows),
        "",
        f"Best over the rounds: warm {b['warm'][0] * 1e3:.0f} / {b['warm'][1] * 1e3:.0f} ms vs "
        f"{o['warm'][0] * 1e3:.0f} / {o['warm'][1] * 1e3:.0f} ms (**{b['warm'][0] / o['warm'][0]:.2f}x** wall, "
        f"{b['warm'][1] / o['warm'][1]:.2f}x CPU; goal within 1.1x); cold {b['cold'][0] * 1e3:.0f} / "
        f"{b['cold'][1] * 1e3:.0f} ms vs {o['cold'][0] * 1e3:.0f} / {o['cold'][1] * 1e3:.0f} ms "
        f"({b['cold'][0] / o['cold'][0]:.2f}x wall).",
    ] + (["", "WRONG: a load did not restore the saved state"] if any_bad else []))
    print(text)
    return 1 if any_bad else 0


def main(argv: list[str] | None = None) -> int:
    from flexshard.spawn import run_workers

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb-per-rank", type=float, nargs="+", default=[50.0],
                   help="MiB of state per rank at the saving world 2 (default 50); several sizes (e.g. 25 100 400) add "
                        "the table of restore against the limit by state size (the first size gives the headline)")
    p.add_argument("--tensors", type=int, default=200, help="tensors in the state (default 200)")
    p.add_argument("--load-worlds", type=int, nargs="+", default=[2, 1, 4], help="world sizes to load at (default: 2 1 4)")
    p.add_argument("--runs", type=int, default=3, help="runs (fresh rank processes per world); figures are medians (default 3)")
    p.add_argument("--loads", type=int, default=3,
                   help="rounds of loads per run, each the raw read then each library's, cold then warm: paired samples "
                        "within a second of each other, less disturbed by a shared machine's load (default 3)")
    p.add_argument("--libs", nargs="+", choices=["flexckpt", "dcp"], default=["flexckpt", "dcp"],
                   help="libraries to save and load (default: both; flexckpt always); the raw read is always measured")
    p.add_argument("--read-threads", type=int, default=None,
                   help="flexckpt Checkpointer(read_threads=...) (default: flexckpt's own default)")
    p.add_argument("--dir", default=None, help="folder for the checkpoints (default: a new temporary folder, removed after)")
    p.add_argument("--out", default=None, help="also write the markdown report here (default bench/out/restore-DATE.md)")
    p.add_argument("--versus", default=None, metavar="REF",
                   help="compare this tree with git revision REF instead: 2 -> 1 in one process (see above)")
    p.add_argument("--repeat", type=int, default=5, help="--versus: loads per kind and round, best taken (default 5)")
    p.add_argument("--one-process", default=None, help=argparse.SUPPRESS)  # --versus's child: its folder
    args = p.parse_args(argv)
    sizes = args.mb_per_rank
    if "flexckpt" not in args.libs:
        p.error(f"--libs {' '.join(args.libs)}: flexckpt must be one of them (its checkpoint is what the raw read reads)")
    if args.loads < 1 or args.runs < 1:
        p.error(f"--runs {args.runs} --loads {args.loads}: each must be at least 1")
    if min(sizes) <= 0 or len(set(sizes)) < len(sizes):
        p.error(f"--mb-per-rank {' '.join(f'{mb:g}' for mb in sizes)}: each size must be above 0 and given once")
    if len(sizes) > 1 and (args.versus or args.one_process):
        p.error(f"--mb-per-rank {' '.join(f'{mb:g}' for mb in sizes)}: --versus measures one size; give one")
    cfg = {"mb_per_rank": sizes[0], "tensors": args.tensors, "read_threads": args.read_threads, "libs": args.libs,
           "loads": args.loads}
    if args.one_process:
        print(json.dumps(_one_process(args.one_process, cfg, args.repeat)))
        return 0
    if args.versus:
        return versus(args, cfg)

    root = args.dir or tempfile.mkdtemp(prefix="flexckpt-restore-")
    os.makedirs(root, exist_ok=True)
    machine = H.machine_description(root)
    t_start = time.monotonic()
    folders = {mb: os.path.join(root, f"state-{mb:g}mib") for mb in sizes}  # each size's own checkpoints
    state_mib: dict[float, float] = {}
    results: dict[float, dict[int, list[list[dict]]]] = {mb: {} for mb in sizes}  # size -> world -> runs -> ranks
    try:
        for mb in sizes:
            os.makedirs(folders[mb], exist_ok=True)
            saved = run_workers(save_worker, SAVE_WORLD, dict(cfg, mb_per_rank=mb), folders[mb], timeout=600)
            state_mib[mb] = sum(r["bytes"] for r in saved) / H.MIB
        for run in range(args.runs):
            for world in args.load_worlds:
                order = [lib for lib in ("flexckpt", "dcp") if lib in args.libs]
                order = order if run % 2 == 0 else order[::-1]
                for mb in (sizes if run % 2 == 0 else sizes[::-1]):  # the sizes take turns as the libraries do
                    ranks = run_workers(load_worker, world, dict(cfg, mb_per_rank=mb), folders[mb], order, timeout=600)
                    results[mb].setdefault(world, []).append(ranks)
                    r = {k: v if k == "bad" else H.median(v) for k, v in _summ(ranks).items()}  # this run's medians
                    dcp = f"dcp cold {r['dcp_cold']:.3f} s warm {r['dcp_warm']:.3f} s; " if "dcp" in args.libs else ""
                    size = f" {mb:g} MiB a rank" if len(sizes) > 1 else ""
                    msg = (f"run {run + 1}/{args.runs} world {world}{size}: flexckpt cold {r['flexckpt_cold']:.3f} s "
                           f"warm {r['flexckpt_warm']:.3f} s; {dcp}raw cold {r['raw_cold']:.3f} s warm {r['raw_warm']:.3f} s; "
                           f"read+checksum cold {r['lim_cold']:.3f} s warm {r['lim_warm']:.3f} s; {H.load_line()}")
                    print(msg + (f"  WRONG: {r['bad']}" if r["bad"] else ""), file=sys.stderr, flush=True)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    wall = time.monotonic() - t_start

    summs = {mb: {world: [_summ(r) for r in results[mb][world]] for world in args.load_worlds} for mb in sizes}
    headline: dict[str, float] = {}  # the medians bench/compare_revisions.py compares (the first size's keys as before)
    any_bad = False
    sections = [
        "## Restore (save at world 2, load at world 2, 1 and 4)",
        "",
        f"Command: `python3 dev.py bench restore {' '.join(sys.argv[1:])}`".rstrip() + f" ({wall / 60:.1f} min)",
        "",
        H.markdown_table(["machine", ""], [[k, v] for k, v in machine.items()] + [["load after", H.load_line()]]),
        "",
    ]
    for i, mb in enumerate(sizes):
        text, head, bad = size_report(args, state_mib[mb], results[mb], summs[mb])
        headline.update({k + ("" if i == 0 else f" ({mb:g} MiB a rank)"): v for k, v in head.items()})
        any_bad |= bad
        if len(sizes) > 1:
            sections += [f"### {mb:g} MiB a rank at world 2 ({state_mib[mb]:.0f} MiB of state)", ""]
        sections += [text, ""]
    if len(sizes) > 1:
        text, head = by_size_report(args, state_mib, summs)
        headline.update(head)
        sections += [text, ""]
    text = "\n".join(sections).rstrip()
    print(text)
    by_size = {"results_by_size": {f"{mb:g}": {str(k): v for k, v in results[mb].items()} for mb in sizes}} if len(sizes) > 1 else {}
    H.write_report("restore", text, {"args": vars(args), "machine": machine, "headline": headline,
                                     "results": {str(k): v for k, v in results[sizes[0]].items()}, **by_size}, args.out)
    return 1 if any_bad else 0


def size_report(args: argparse.Namespace, state_mib: float, results: dict[int, list[list[dict]]],
                summs: dict[int, list[dict]]) -> tuple[str, dict[str, float], bool]:
    """One state size's tables (restore against dcp and the raw read, against the limit, where a
    warm load's time went, the goals), its headline medians and whether a load came out wrong."""
    rows, goal_rows, limit_rows, phase_rows = [], [], [], []
    headline: dict[str, float] = {}
    any_bad = False
    for world in args.load_worlds:
        summ = summs[world]
        limit, got = limit_row(world, summ)
        limit_rows.append(limit)
        phase_rows.append(phase_row(world, summ))
        for kind in ("cold", "warm"):
            headline[f"restore 2->{world} {kind} s"] = H.median(x for s in summ for x in s[f"flexckpt_{kind}"])
            headline[f"restore/limit 2->{world} {kind}"] = got[kind][0]
        goal_rows.append([f"2 -> {world}", f"<= {LIMIT_GOAL}x (raw read + checksum), median (cold / warm; issue 29)",
                          f"{got['cold'][0]:.2f}x / {got['warm'][0]:.2f}x",
                          _ok(got["cold"][0] <= LIMIT_GOAL and got["warm"][0] <= LIMIT_GOAL)])
        med = {k: H.median(x for s in summ for x in s[k]) for k in KEYS}  # over every round of every run
        bad = sorted({b for s in summ for b in s["bad"]})
        any_bad |= bool(bad)
        mibs = {k: state_mib / v for k, v in med.items() if "cpu" not in k}
        rows.append([
            f"2 -> {world}",
            f"{med['flexckpt_cold']:.3f} s ({mibs['flexckpt_cold']:.0f})", f"{med['dcp_cold']:.3f} s ({mibs['dcp_cold']:.0f})",
            f"{med['dcp_cold'] / med['flexckpt_cold']:.2f}x", f"{mibs['raw_cold']:.0f}",
            f"{med['flexckpt_warm']:.3f} s ({mibs['flexckpt_warm']:.0f})", f"{med['dcp_warm']:.3f} s ({mibs['dcp_warm']:.0f})",
            f"{med['dcp_warm'] / med['flexckpt_warm']:.2f}x", f"{mibs['raw_warm']:.0f}",
            f"{med['flexckpt_cpu_cold']:.3f} / {med['flexckpt_cpu_warm']:.3f} s",
            "ok" if not bad else "WRONG: " + ", ".join(bad[:3]),
        ])
        goal_rows += [
            [f"2 -> {world}", ">= 2x dcp.load (cold / warm)", f"{med['dcp_cold'] / med['flexckpt_cold']:.2f}x / {med['dcp_warm'] / med['flexckpt_warm']:.2f}x",
             _ok(med["dcp_cold"] >= 2 * med["flexckpt_cold"] and med["dcp_warm"] >= 2 * med["flexckpt_warm"])],
        ] if "dcp" in args.libs else []
        goal_rows += [
            [f"2 -> {world}", ">= 80% of cold raw read (issue 18)", f"{mibs['flexckpt_cold']:.0f} vs {mibs['raw_cold']:.0f} MiB/s ({mibs['flexckpt_cold'] / mibs['raw_cold'] * 100:.0f}%)",
             _ok(mibs["flexckpt_cold"] >= 0.8 * mibs["raw_cold"])],
            [f"2 -> {world}", ">= 60% of warm raw read (issue 18)", f"{mibs['flexckpt_warm']:.0f} vs {mibs['raw_warm']:.0f} MiB/s ({mibs['flexckpt_warm'] / mibs['raw_warm'] * 100:.0f}%)",
             _ok(mibs["flexckpt_warm"] >= 0.6 * mibs["raw_warm"])],
        ]
    resident = max(r["resident"] for rs in results.values() for ranks in rs for r in ranks)
    stats = results[args.load_worlds[0]][0][0].get("flexckpt_stats", {})
    text = "\n".join([
        f"State: {state_mib:.1f} MiB in {args.tensors} tensors (Shard(0) pieces, fp32), saved once by each library at world 2; "
        f"{args.runs} runs of {args.loads} rounds each (a round: the raw read, then each library's load, cold then warm), "
        f"medians over every round; seconds of the slowest rank (MiB/s of the whole state in brackets); flexckpt CPU: the "
        f"CPU seconds of the busiest rank's process (every thread) in its load, cold / warm. Cold = every file of "
        f"both checkpoints dropped from the page cache (fadvise DONTNEED; at most {resident * 100:.0f}% of any file resident "
        f"after the drop). Raw = pread of the flexckpt data files split evenly over the ranks. flexckpt read_threads="
        f"{args.read_threads or 'default'}; e.g. rank 0 at world {args.load_worlds[0]} read {stats.get('bytes_read', 0) / H.MIB:.1f} MiB in "
        f"{stats.get('fetches', '?')} fetches ({stats.get('direct_chunks', '?')} of {stats.get('chunks', '?')} chunks straight into the targets).",
        "",
        H.markdown_table(*_without_dcp(["load", "flexckpt cold", "dcp.load cold", "speed-up", "raw cold MiB/s", "flexckpt warm",
                                        "dcp.load warm", "speed-up", "raw warm MiB/s", "flexckpt CPU", "loaded state"], rows, args.libs)),
        "",
        "### Restore against this machine's limit: the raw read plus the checksum pass of the same bytes (issue 29)",
        "",
        f"Per rank, the limit preads as many bytes of the flexckpt data files as that rank's load reads from the store "
        f"(its `bytes_read`; rank 0 at world {args.load_worlds[0]}: {results[args.load_worlds[0]][0][0]['limit_bytes'] / H.MIB:.1f} MiB), "
        f"from its even share's start on, into one buffer, then runs flexckpt's checksum (xxh3-64, `flexckpt.format.checksum`) "
        f"over it in chunk_bytes pieces; seconds of the slowest rank (read + checksum in brackets, medians); the ratio is "
        f"the restore's over the limit's, round by round. Median / p99 (nearest rank: at fewer than 100 rounds, the "
        f"largest) over {args.runs} runs x {args.loads} rounds. Cold as above (the page cache dropped before the "
        f"limit's read and before the load); warm: right after.",
        "",
        H.markdown_table(["load", "restore cold s (median / p99)", "limit cold s", "ratio cold (median / p99)",
                          "restore warm s", "limit warm s", "ratio warm", "rounds"], limit_rows),
        "",
        "Where a warm load's time goes (`last_load_stats`: plan = manifest read and parsed, checks, chunk tables, "
        "read plan; fetch = bytes read, verified, placed; agree = the step and success agreements, waiting for the "
        "slowest rank included; apply = values set; ms, the ranks' mean, median over the rounds), against the limit; "
        "and the first load of each rank process (slowest rank, median over the runs: what a restarted job's load pays "
        "once, imports and first-use caches included; the timed rounds are later loads of the same process):",
        "",
        H.markdown_table(["load", "restore warm ms (slowest rank)", "plan", "fetch", "agree", "apply", "limit warm ms",
                          "fetch / limit", "first load of a process, warm ms (/ limit)"], phase_rows),
        "",
        "### flexckpt against the issue's load goals (this run)",
        "",
        H.markdown_table(["load", "goal", "measured", "met"], goal_rows),
    ])
    return text, headline, any_bad


def _ok(b: bool) -> str:
    return "yes" if b else "**no**"


def _without_dcp(header: list[str], rows: list[list[str]], libs: list[str]) -> tuple[list[str], list[list[str]]]:
    """The table without dcp's columns (its time and the speed-up) when ``--libs`` left dcp out."""
    if "dcp" in libs:
        return header, rows
    keep = [i for i in range(len(header)) if i not in (2, 3, 6, 7)]
    return [header[i] for i in keep], [[row[i] for i in keep] for row in rows]


KEYS = ("flexckpt_cold", "flexckpt_warm", "dcp_cold", "dcp_warm", "raw_cold", "raw_warm",
        "flexckpt_cpu_cold", "flexckpt_cpu_warm", *LIMIT_KEYS)
LIMIT_GOAL = 1.25  # issue 29: restore <= 1.25 x (raw read + checksum of the same bytes)


def limit_row(world: int, summ: list[dict]) -> tuple[list[str], dict]:
    """One row of the restore-against-the-limit table: per kind (cold, warm) the restore's
    and the limit's median and p99 seconds (slowest rank of each round, over every round of
    every run) and the median and p99 of the rounds' ratios restore / (read + checksum)."""
    row, got = [f"2 -> {world}"], {}
    for kind in ("cold", "warm"):
        rest, lim, ratios = _limit_rounds(summ, kind)
        read = H.median(x for s in summ for x in s[f"lim_read_{kind}"])
        sums = H.median(x for s in summ for x in s[f"lim_sum_{kind}"])
        got[kind] = (H.median(ratios), H.percentile(ratios, 99))
        row += [f"{H.median(rest):.3f} / {H.percentile(rest, 99):.3f}",
                f"{H.median(lim):.3f} / {H.percentile(lim, 99):.3f} ({read:.3f} + {sums:.3f})",
                f"**{got[kind][0]:.2f}** / {got[kind][1]:.2f}"]
    return row + [str(len(ratios))], got


def _limit_rounds(summ: list[dict], kind: str) -> tuple[list[float], list[float], list[float]]:
    """The restore's and the limit's seconds (slowest rank) in every round of every run, and
    the rounds' ratios restore / limit."""
    rest = [x for s in summ for x in s[f"flexckpt_{kind}"]]
    lim = [x for s in summ for x in s[f"lim_{kind}"]]
    return rest, lim, [a / b for a, b in zip(rest, lim)]


class LimitFit(NamedTuple):
    """restore = ``fixed_s`` + ``ratio`` x limit, fitted across state sizes."""

    fixed_s: float  # F: what a load costs whatever its bytes (plan, agreements, waiting for the slowest rank)
    ratio: float  # r: the restore's per-byte cost over the limit's (the ratio at a large state)
    limit_mib_s: float  # the limit's throughput: MiB of state per second of limit, over every size
    goal_state_mib: float | None  # the smallest state whose ratio F / limit + r is <= the goal; None: never


def fit_against_limit(points: Sequence[tuple[float, float, float]], goal: float = LIMIT_GOAL) -> LimitFit:
    """Least squares of restore = F + r x limit through ``points`` (state MiB, limit s,
    restore s), one a state size: F, r, and the smallest state at which the ratio
    restore / limit = F / limit + r is at most ``goal``: a limit of F / (goal - r) seconds,
    in MiB of state at the limit's throughput (the points' MiB over their limit seconds,
    summed); 0 when F <= 0 (every size), None (never) when r >= ``goal``."""
    if len(points) < 2 or len({lim for _, lim, _ in points}) < 2:
        raise ValueError(f"{len(points)} state sizes with limits {[lim for _, lim, _ in points]}: "
                         f"a fit needs two sizes or more whose limits differ")
    xs, ys = [lim for _, lim, _ in points], [rest for _, _, rest in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    r = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    f = my - r * mx
    mib_s = sum(mib for mib, _, _ in points) / sum(xs)
    goal_mib = None if r >= goal else 0.0 if f <= 0 else f / (goal - r) * mib_s
    return LimitFit(f, r, mib_s, goal_mib)


def by_size_report(args: argparse.Namespace, state_mib: dict[float, float],
                   summs: dict[float, dict[int, list[dict]]]) -> tuple[str, dict[str, float]]:
    """The table of restore against the limit by state size, with the fit of each load world
    and kind (``fit_against_limit`` over the sizes' medians), and its headline figures."""
    sizes = list(state_mib)
    rows, headline = [], {}
    for world in args.load_worlds:
        for kind in ("cold", "warm"):
            cells, points = [], []
            for mb in sizes:
                rest, lim, ratios = _limit_rounds(summs[mb][world], kind)
                points.append((state_mib[mb], H.median(lim), H.median(rest)))
                cells.append(f"{points[-1][2] * 1e3:.1f} / {points[-1][1] * 1e3:.1f} ({H.median(ratios):.2f}x)")
            try:
                fit = fit_against_limit(points)
            except ValueError as e:
                rows.append([f"2 -> {world}", kind, *cells, f"n/a: {e}", "", "", ""])
                continue
            headline[f"restore fixed s 2->{world} {kind}"] = fit.fixed_s
            headline[f"restore per-byte/limit 2->{world} {kind}"] = fit.ratio
            goal = ("never" if fit.goal_state_mib is None else "every size" if fit.goal_state_mib == 0 else
                    f"{fit.goal_state_mib:.0f} MiB ({fit.goal_state_mib / SAVE_WORLD:.0f} a rank)")
            rows.append([f"2 -> {world}", kind, *cells, f"{fit.fixed_s * 1e3:.1f}", f"{fit.ratio:.2f}",
                         f"{fit.limit_mib_s:.0f}", goal])
    return "\n".join([
        "### Restore against the limit by state size: a fixed cost a load and a cost a byte (issue 29)",
        "",
        f"Per load and kind, at each state size: the restore's and the limit's medians (ms, slowest rank of each "
        f"round, every round of every run, as above) and the median of the rounds' ratios. Then a least-squares line "
        f"through the sizes' medians (one point a size, not each round's pair: a disturbed round moves it less; with "
        f"two sizes the line goes through both), restore = F + r x limit: F is what a load costs whatever its bytes "
        f"(ms; plan, agreements, the wait for the slowest rank), r the restore's cost a byte over the limit's (what "
        f"the ratio tends to at a large state). The median ratio F / limit + r is at most {LIMIT_GOAL} from a limit "
        f"of F / ({LIMIT_GOAL} - r) s on, given as MiB of state at the limit's throughput (the sizes' state MiB over "
        f"their limit medians, summed); never where r >= {LIMIT_GOAL}.",
        "",
        H.markdown_table(["load", "kind", *(f"{mb:g} MiB a rank: restore / limit ms (ratio)" for mb in sizes),
                          "F ms", "r", "limit MiB/s", f"ratio <= {LIMIT_GOAL} from"], rows),
    ]), headline


def _summ(ranks: list[dict]) -> dict:
    """Per key, the slowest rank's seconds in each round of loads (a list, one a round)."""
    rounds = len(ranks[0]["raw_cold"])
    out: dict[str, Any] = {k: [max(r[k][i] if k in r else math.nan for r in ranks) for i in range(rounds)]
                           for k in KEYS}  # nan: a library left out (--libs)
    out["bad"] = sorted({b for r in ranks for lib in ("flexckpt", "dcp") for b in r.get(f"{lib}_bad", [])})
    out["first_warm"] = [max(r["first_warm"] for r in ranks)]  # one a run
    for ph in PHASES:  # the ranks' mean in each round
        out[f"{ph}_warm"] = [sum(r[f"{ph}_warm"][i] for r in ranks) / len(ranks) if f"{ph}_warm" in ranks[0] else math.nan
                             for i in range(rounds)]
    return out


def phase_row(world: int, summ: list[dict]) -> list[str]:
    """Where a warm load's seconds went (``LoadStats``' phases, the ranks' mean, median over
    the rounds) beside the load (slowest rank) and the limit."""
    med = {k: H.median(x for s in summ for x in s[k]) for k in ("flexckpt_warm", "lim_warm", *(f"{p}_warm" for p in PHASES))}
    ms = lambda k: f"{med[k] * 1e3:.1f}"  # noqa: E731
    first = H.median(x for s in summ for x in s["first_warm"])
    return [f"2 -> {world}", ms("flexckpt_warm"), *(ms(f"{p}_warm") for p in PHASES), ms("lim_warm"),
            f"{med['fetch_s_warm'] / med['lim_warm']:.2f}x", f"{first * 1e3:.1f} ({first / med['lim_warm']:.2f}x)"]


if __name__ == "__main__":
    sys.exit(main())
