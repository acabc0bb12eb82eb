"""What the checkpoint benchmarks share: the synthetic training state, the step workload,
the storage and memory references, statistics, the machine description and markdown
tables. Used by ``save_latency.py`` and ``restore.py``; not part of the packages.

The state is a model-like set of fp32 tensors, every one sharded along dim 0 (FSDP-style),
so each rank holds and writes distinct bytes. Element values are small integers computed
from (tensor id, global flat index), so any rank can rebuild any piece at any world size,
and the in-place "optimizer" (``+= 1``) keeps them exact: the state saved at version ``v``
is ``base + v`` exactly, which is what the correctness guards compare against.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import datetime as _dt
import json
import math
import mmap
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from flexshard import Shard
from flexshard.layout import local_shape

MIB = 1 << 20
COLS = 1024  # elements per row of every matrix: 4 KiB rows


# -- the state ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorSpec:
    name: str
    tid: int
    global_shape: tuple[int, ...]


def flexckpt_module(name: str):
    """A flexckpt module by its path since the move into folders (``load.pending``), or by its
    flat path before it (``load``): ``compare_revisions`` runs this bench code against the
    ``src`` of revisions from before the move too."""
    import importlib

    flat = {"load.pending": "load", "format.checksum": "checksum"}
    try:
        return importlib.import_module(f"flexckpt.{name}")
    except ModuleNotFoundError:
        return importlib.import_module(f"flexckpt.{flat[name]}")


def state_specs(mb_per_rank: float, n_tensors: int, world: int) -> list[TensorSpec]:
    """``n_tensors`` global tensors whose Shard(0) pieces total ``mb_per_rank`` MiB per rank
    at ``world`` ranks: one third are small vectors (norms, biases), the rest matrices in
    a 1:3 size pattern (attention-like and MLP-like). Every global row count is a multiple
    of ``2 * world``, so a state made at world 2 also splits evenly at world 1 and 4."""
    if n_tensors < 3:
        raise ValueError(f"--tensors must be >= 3, got {n_tensors}")
    n_vec = n_tensors // 3
    n_mat = n_tensors - n_vec
    vec_local = COLS  # 4 KiB per rank each
    target = mb_per_rank * MIB - n_vec * vec_local * 4
    weights = [1 if j % 2 == 0 else 3 for j in range(n_mat)]
    unit = max(target, 0) / sum(weights) / (COLS * 4)
    specs: list[TensorSpec] = []
    mat = vec = 0
    for tid in range(n_tensors):
        if tid % 3 == 2 and vec < n_vec:
            specs.append(TensorSpec(f"layers.{tid // 3}.norm", tid, (world * vec_local,)))
            vec += 1
        else:
            rows_local = max(2, 2 * round(unit * weights[mat] / 2))
            kind = "attn" if weights[mat] == 1 else "mlp"
            specs.append(TensorSpec(f"layers.{tid // 3}.{kind}{tid % 3}", tid, (world * rows_local, COLS)))
            mat += 1
    return specs


def piece_range(spec: TensorSpec, rank: int, world: int) -> tuple[int, int, tuple[int, ...]]:
    r = Shard(0).flat_range(spec.global_shape, world, rank)
    return r.start, r.stop, local_shape(Shard(0), spec.global_shape, world, rank)


def base_piece(spec: TensorSpec, rank: int, world: int, version: int = 0) -> torch.Tensor:
    """This rank's piece of tensor ``spec`` at state version ``version``."""
    start, stop, shape = piece_range(spec, rank, world)
    idx = torch.arange(start, stop, dtype=torch.int64)
    vals = (idx * 7919 + spec.tid * 104729) % 2039 - 1019 + version
    return vals.to(torch.float32).view(shape)


def build_local_state(specs: Sequence[TensorSpec], rank: int, world: int, version: int = 0) -> dict[str, torch.Tensor]:
    return {s.name: base_piece(s, rank, world, version) for s in specs}


def zeros_like_state(local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in local.items()}


def state_bytes(local: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in local.values())


def mismatches(loaded: dict[str, torch.Tensor], specs: Sequence[TensorSpec], rank: int, world: int, version: int) -> list[str]:
    """Names of the tensors in ``loaded`` that differ from the state at ``version``."""
    bad = []
    for s in specs:
        got = loaded.get(s.name)
        if got is None or not torch.equal(got, base_piece(s, rank, world, version)):
            bad.append(s.name)
    return bad


# -- the step ----------------------------------------------------------------------------------
class Workload:
    """The trainer's step between saves: matmuls that read every matrix of the state
    (forward/backward stand-in; the state is read, never written), then a small gradient
    all-reduce that couples the ranks like data-parallel training does."""

    def __init__(self, local: dict[str, torch.Tensor], batch: int = 32, grad_elems: int = 1 << 16) -> None:
        self.mats = [t for t in local.values() if t.dim() == 2 and t.numel()]
        gen = torch.Generator().manual_seed(1234)
        self._x = {r: torch.randn(batch, r, generator=gen) for r in {t.shape[0] for t in self.mats}}
        self._out = {c: torch.empty(batch, c) for c in {t.shape[1] for t in self.mats}}
        self.grad = torch.ones(grad_elems)

    def ops(self, n: int) -> None:
        mats, xs, outs = self.mats, self._x, self._out
        m = len(mats)
        for i in range(n):
            t = mats[i % m]
            torch.mm(xs[t.shape[0]], t, out=outs[t.shape[1]])

    def allreduce(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.all_reduce(self.grad)

    def calibrate(self, step_seconds: float) -> int:
        """Matmuls per step so that one step of work takes about ``step_seconds`` with every
        rank computing at once (so on an oversubscribed machine the step is still that long).
        Every rank returns the same count (the mean of the ranks' rates)."""
        import torch.distributed as dist

        self.ops(len(self.mats))  # warm-up
        t0 = time.perf_counter()
        n = len(self.mats)
        self.ops(n)
        guess = n / (time.perf_counter() - t0)
        rates = []
        for _ in range(3):  # about 0.4 s each
            n = max(len(self.mats), int(guess * 0.4))
            t0 = time.perf_counter()
            self.ops(n)
            rates.append(n / (time.perf_counter() - t0))
        rate = torch.tensor([statistics.median(rates)], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(rate)
            rate /= dist.get_world_size()
        return max(1, int(round(float(rate) * step_seconds)))


def optimizer_step(local: dict[str, torch.Tensor]) -> None:
    """The in-place change of every tensor (a fused optimizer's foreach update)."""
    torch._foreach_add_(list(local.values()), 1.0)


# -- process measurements ----------------------------------------------------------------------
_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def rusage() -> tuple[int, int, int]:
    """(minor page faults, major page faults, involuntary context switches) of this process."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_minflt, r.ru_majflt, r.ru_nivcsw


class GcWatch:
    """Counts garbage collections and their pause while active (any thread)."""

    def __init__(self) -> None:
        import gc

        self.pauses: dict[int, list[float]] = {0: [], 1: [], 2: []}
        self._t0 = 0.0
        self._gc = gc
        gc.callbacks.append(self._cb)

    def _cb(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.pauses[info["generation"]].append(time.perf_counter() - self._t0)

    def reset(self) -> None:
        for v in self.pauses.values():
            v.clear()

    def close(self) -> None:
        if self._cb in self._gc.callbacks:
            self._gc.callbacks.remove(self._cb)


def settle_heap() -> None:
    """End of the trainer's set-up: collect once and freeze what survives (torchtitan-style
    GC handling), so the first save does not pay for a full collection over every object
    torch's import created (~170k objects, ~85 ms here)."""
    import gc

    gc.collect()
    gc.freeze()


# -- storage and memory references -------------------------------------------------------------
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def resident_fraction(path: str) -> float:
    """Fraction of ``path``'s pages in the page cache (mincore on a fresh shared mapping)."""
    size = os.path.getsize(path)
    if size == 0:
        return 0.0
    _libc.mmap.restype = ctypes.c_void_p
    _libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    _libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    _libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            return float("nan")
        try:
            pages = (size + _PAGE - 1) // _PAGE
            vec = (ctypes.c_ubyte * pages)()
            if _libc.mincore(addr, size, vec) != 0:
                return float("nan")
            return sum(b & 1 for b in vec) / pages
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)


def drop_from_page_cache(path: str) -> None:
    """Evict ``path``'s (clean) pages: fsync, then POSIX_FADV_DONTNEED. Needs no root."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def write_file(path: str, data: memoryview, fsync: bool = True, piece: int = 8 * MIB) -> float:
    """Seconds to write ``data`` to a new file (and fsync it)."""
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        pos, n = 0, data.nbytes
        while pos < n:
            pos += os.write(fd, data[pos : min(n, pos + piece)])
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def read_file(path: str, out: memoryview, piece: int = 8 * MIB) -> float:
    """Seconds to read ``path`` into ``out`` (pread, in pieces)."""
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        pos, n = 0, out.nbytes
        while pos < n:
            k = os.preadv(fd, [out[pos : min(n, pos + piece)]], pos)
            if k == 0:
                raise EOFError(path)
            pos += k
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def storage_references(folder: str, nbytes: int, rank: int, reps: int = 3) -> dict[str, float]:
    """Raw storage bandwidth for this rank's bytes, every rank at once (the caller keeps
    the ranks in step with barriers): write+fsync, warm read, cold read (page cache dropped
    for the file with fadvise; the resident fraction after the drop is reported)."""
    import torch.distributed as dist

    def barrier() -> None:
        if dist.is_initialized():
            dist.barrier()

    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    dst = torch.empty(nbytes, dtype=torch.uint8)
    dst.fill_(1)
    path = os.path.join(folder, f"raw-{rank}.bin")
    w, rw, rc, resident = [], [], [], []
    for _ in range(reps):
        barrier()
        w.append(write_file(path, memoryview(src.numpy())))
        barrier()
        rw.append(read_file(path, memoryview(dst.numpy())))
        drop_from_page_cache(path)
        resident.append(resident_fraction(path))
        barrier()
        rc.append(read_file(path, memoryview(dst.numpy())))
        barrier()
    os.remove(path)
    if not torch.equal(src, dst):
        raise RuntimeError("raw storage reference read back different bytes")
    mb = nbytes / MIB
    return {
        "write_mibs": mb / statistics.median(w),
        "read_warm_mibs": mb / statistics.median(rw),
        "read_cold_mibs": mb / statistics.median(rc),
        "cold_resident": max(resident),
    }


def memory_references(local: dict[str, torch.Tensor], reps: int = 5) -> dict[str, float]:
    """One memcpy of the rank's bytes into a reused buffer (contiguous source), and the
    same bytes copied tensor by tensor into views of one flat buffer (what a flat-buffer
    stager does: ``torch._foreach_copy_``)."""
    import torch.distributed as dist

    nbytes = state_bytes(local)
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    flat = torch.zeros(nbytes, dtype=torch.uint8)
    views, off = [], 0
    for t in local.values():
        n = t.numel() * t.element_size()
        views.append(flat[off : off + n].view(t.dtype).view(t.shape))
        off += n
    srcs = list(local.values())
    memcpy, foreach = [], []
    for _ in range(reps + 1):
        if dist.is_initialized():
            dist.barrier()
        t0 = time.perf_counter()
        dst.copy_(src)
        memcpy.append(time.perf_counter() - t0)
        if dist.is_initialized():
            dist.barrier()
        t0 = time.perf_counter()
        torch._foreach_copy_(views, srcs)
        foreach.append(time.perf_counter() - t0)
    return {"memcpy_s": statistics.median(memcpy[1:]), "foreach_s": statistics.median(foreach[1:])}


# -- statistics --------------------------------------------------------------------------------
def percentile(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile: the ceil(p/100 * n)-th smallest value (p99 of 100 values is
    the 99th, p50 of 100 the 50th; p100 is the max)."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = max(1, math.ceil(p / 100.0 * len(s)))
    return s[min(k, len(s)) - 1]


def median(values: Iterable[float]) -> float:
    vals = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return statistics.median(vals) if vals else float("nan")


# -- reporting ---------------------------------------------------------------------------------
def write_report(bench: str, text: str, doc: dict, out: str | None) -> str:
    """The report's markdown (``out``, else ``bench/out/BENCH-<time>.md``) and, beside it,
    ``doc`` as JSON (values JSON lacks written as their ``str``); the markdown's path."""
    out = out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", f"{bench}-{time.strftime('%Y%m%d-%H%M%S')}.md")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        f.write(text + "\n")
    with open(os.path.splitext(out)[0] + ".json", "w") as f:
        json.dump(doc, f, default=str)
    print(f"\n(report written to {out})", file=sys.stderr)
    return out


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(str(c) for c in r) + " |")
    return "\n".join(lines)


def fmt_ms(seconds: float) -> str:
    if seconds is None or math.isnan(seconds):
        return "-"
    ms = seconds * 1000
    return f"{ms:.1f}" if ms < 100 else f"{ms:.0f}"


def fmt(x: float, digits: int = 0) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.{digits}f}"


def _first_line(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception:  # noqa: BLE001 - a description, not a requirement
        return ""


def machine_description(folder: str) -> dict[str, str]:
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = ""
    try:
        with open("/proc/meminfo") as f:
            kb = int(f.readline().split()[1])
            mem = f"{kb / (1 << 20):.1f} GiB"
    except OSError:
        pass
    df = _first_line(["df", "-hT", folder]).splitlines()
    disk = " ".join(df[-1].split()[:3]) if df else ""
    import torch_checkpointing  # noqa: F401 - version only

    try:
        from importlib.metadata import version

        tc_version = version("torch-checkpointing")
    except Exception:  # noqa: BLE001
        tc_version = "?"
    return {
        "date": _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "cpu": f"{cpu} ({os.cpu_count()} logical CPUs)",
        "ram": mem,
        "disk": f"{disk} (checkpoints under {folder})",
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch-checkpointing": tc_version,
        "load before": load_line(),
    }


def load_line() -> str:
    try:
        one, five, fifteen = os.getloadavg()
        return f"load average {one:.2f} {five:.2f} {fifteen:.2f}"
    except OSError:
        return "?"


def busy_processes(limit: int = 5) -> str:
    """The top CPU users right now (to say whether other work shared the machine)."""
    out = _first_line(["ps", "-eo", "pid,pcpu,comm", "--sort=-pcpu"])
    me = str(os.getpid())
    rows = [ln.split(None, 1) for ln in out.splitlines()[1:]]
    lines = [rest.strip() for pid, rest in rows if pid != me][:limit]
    return "; ".join(lines) + " (ps: CPU % over each process's lifetime)"
