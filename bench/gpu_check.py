"""The GPU check (issue 18): one prepared script, one GPU, world size 1, under 4 minutes.

    OUT=/some/folder python3 bench/gpu_check.py          # every part, each with its own timeout
    python3 bench/gpu_check.py --part staging           # one part, no timeout (what the runner calls)

Each part runs in a child process with its own timeout; every row is appended to
``$OUT/gpu_check.jsonl`` the moment it is measured and the table ``$OUT/gpu_check.md`` is
rewritten after each part (``OUT`` defaults to ``bench/gpu_check_out``). A part that fails
or runs out of time leaves a row saying so, and the others still run.

Parts:
- ``roundtrip``: a flexckpt save of CUDA tensors (fp32, bf16, fp8, int64, a ShardedTensor,
  a DTensor on a one-rank NCCL mesh) staged through the side stream, loaded back into CUDA
  tensors: bit-exact. Also ShardedOptimizer on CUDA over NCCL (full and MXFP8 gathers).
- ``flextrain``: ``tiny`` on the GPU for 20 steps; a second run killed (SIGKILL) after about
  11 steps and resumed from its newest checkpoint; every later step must log the very same losses
  and global batches as the uninterrupted run.
- ``staging``: device-to-host staging GB/s (flexckpt's StreamCopies into a reused pinned
  buffer) against one plain ``copy_`` of the same bytes into pinned memory (the limit).
- ``wait``: the trainer's wait per checkpoint (time in save() plus at the fence) with 2 GB
  of GPU state, a save every 3 steps of GPU work: flexckpt against DCP async_save with a
  pinned-memory async stager and against torch_checkpointing with pinned staging.
- ``mxfp8``: flexshard's MXFP8 quantize (row, column, tile blocks) of an 8192 x 8192 fp32
  matrix against a bf16 cast of it, CUDA event timing.
- ``fanout``: the load's read-once fan-out over NCCL (``Checkpointer(fanout="nccl")``): its
  device wire's copies (a 4 MiB batch to the GPU and back, bit-exact) and, on 2+ GPUs only
  (NCCL takes one GPU a rank), a replicated 64 MB state saved at W=2 and loaded with the
  NCCL fan-out: bit-exact, each stored byte read once (the byte counters).

Without CUDA it prints why and exits 0. Multi-rank NCCL needs more than one GPU: only
``fanout``'s W=2 load uses two, and says so where there is one.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(REPO / "src")]

import torch  # noqa: E402

TIMEOUTS = {"roundtrip": 30, "mxfp8": 20, "staging": 30, "flextrain": 60, "wait": 75, "fanout": 20}  # 235 s
GB = 1e9


# --- rows and the table --------------------------------------------------------------------------

def out_dir() -> Path:
    path = Path(os.environ.get("OUT") or HERE / "gpu_check_out")
    path.mkdir(parents=True, exist_ok=True)
    return path


def emit(row: dict, out: Path) -> None:
    """Append one row now (a part killed later keeps what it measured)."""
    with open(out / "gpu_check.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    print("ROW " + json.dumps(row), flush=True)


def table(rows: list[dict]) -> str:
    lines = ["| part | what | value | against | ratio | ok |", "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        ratio = r.get("ratio")
        lines.append(f"| {r.get('part', '')} | {r.get('what', '')} | {r.get('value', '')} | {r.get('against', '')} | "
                     f"{'' if ratio is None else f'{ratio:.2f}'} | {'' if r.get('ok') is None else ('yes' if r['ok'] else 'NO')} |")
    return "\n".join(lines) + "\n"


def read_rows(out: Path) -> list[dict]:
    path = out / "gpu_check.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []


def run_part(name: str, timeout: float, out: Path, argv: list[str] | None = None) -> dict:
    """Run one part in a child with its own timeout; returns a status row (also emitted)."""
    cmd = argv or [sys.executable, str(Path(__file__).resolve()), "--part", name]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, OUT=str(out), PYTHONUNBUFFERED="1"), start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout)
        status = "done" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        status = f"timed out after {timeout:.0f} s"
    (out / f"gpu_check_{name}.log").write_text(log or "")
    row = {"part": name, "what": "status", "value": status, "seconds": round(time.perf_counter() - t0, 1),
           "ok": status == "done"}
    if status != "done":
        row["tail"] = (log or "")[-1500:]
    emit(row, out)
    return row


def run_all(parts: list[str], out: Path, runner: Callable[[str, float, Path], dict] = run_part) -> int:
    failed = 0
    for name in parts:
        failed += not runner(name, TIMEOUTS[name], out)["ok"]
        (out / "gpu_check.md").write_text(table(read_rows(out)))
    rows = read_rows(out)
    failed += sum(1 for r in rows if r.get("ok") is False and r.get("what") != "status")
    print(table(rows))
    return 1 if failed else 0


# --- timing helpers ------------------------------------------------------------------------------

def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device, repeat: int, warmup: int = 1) -> float:
    """Median seconds of ``fn`` (synchronized before and after)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def one_rank_group(device: torch.device, folder: str) -> None:
    """A world of one (FileStore, no port): NCCL for CUDA tensors, gloo for CPU ones."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    store = dist.FileStore(os.path.join(folder, "store"), 1)
    dist.init_process_group(backend, store=store, rank=0, world_size=1)


# --- parts ---------------------------------------------------------------------------------------

def part_roundtrip(device: torch.device, small: bool = False) -> Iterator[dict]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard as DShard, distribute_tensor

    from flexckpt import Checkpointer
    from flexckpt.save.staging import copies_for
    from flexshard import BlockShard, ShardedOptimizer, ShardedTensor, ShardingConfig

    g = torch.Generator().manual_seed(0)
    n = 1 << (12 if small else 22)
    with tempfile.TemporaryDirectory() as tmp:
        one_rank_group(device, tmp)
        mesh = init_device_mesh(device.type, (1,))
        state = {
            "w": torch.randn(n, generator=g).to(device),
            "h": torch.randn(n // 4, 4, generator=g).to(torch.bfloat16).to(device),
            "f8": torch.randn(1000, generator=g).to(torch.float8_e4m3fn).to(device),
            "i": torch.arange(777, dtype=torch.int64).to(device),
            "st": ShardedTensor(torch.randn(64, 48, generator=g).to(device), BlockShard(32), (64, 48), 0, 1),
            "dt": distribute_tensor(torch.randn(96, 40, generator=g).to(device), mesh, [DShard(0)]),
            "step": 7,
        }
        want = {k: (v.local if isinstance(v, ShardedTensor) else v.to_local() if k == "dt" else v).clone()
                if k != "step" else v for k, v in state.items()}
        with Checkpointer(os.path.join(tmp, "ckpt")) as ckpt:
            t0 = time.perf_counter()
            h = ckpt.save(1, state)
            save_s = time.perf_counter() - t0
            h.wait_staged()
            h.result()
            copies = type(copies_for(device)).__name__  # how a save stages from this device (the one place that decides)
            target = {
                "w": torch.zeros_like(state["w"]), "h": torch.zeros_like(state["h"]),
                "f8": torch.zeros_like(state["f8"]), "i": torch.zeros_like(state["i"]),
                "st": ShardedTensor(torch.zeros_like(state["st"].local), BlockShard(32), (64, 48), 0, 1),
                "dt": distribute_tensor(torch.zeros(96, 40, device=device), mesh, [DShard(0)]), "step": 0,
            }
            ckpt.load(target)
        got = {k: (v.local if isinstance(v, ShardedTensor) else v.to_local() if k == "dt" else v) for k, v in target.items()}
        bad = [k for k in want if k != "step" and not (got[k].device == want[k].device
               and torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)))]
        if got["step"] != 7:
            bad.append("step")
        nbytes = sum(t.numel() * t.element_size() for k, t in want.items() if k != "step")
        want_copies = "StreamCopies" if device.type == "cuda" else "HostCopies"
        yield {"part": "roundtrip", "what": f"flexckpt save+load of {nbytes / 1e6:.1f} MB from {device.type} tensors "
               f"({copies}, save() {save_s * 1e3:.2f} ms)", "value": "bit-exact" if not bad else f"differs: {bad}",
               "ok": not bad and copies == want_copies}
        # ShardedOptimizer on the device over the one-rank group (NCCL on CUDA)
        for compute_copy in ("full", "mxfp8"):
            params = {"a": torch.nn.Parameter(torch.randn(256, 128, generator=g).to(device)),
                      "b": torch.nn.Parameter(torch.randn(256, generator=g).to(device))}
            opt = ShardedOptimizer(params, sharding=ShardingConfig(compute_copy=compute_copy))
            before = {k: p.detach().clone() for k, p in params.items()}
            for _ in range(3):
                for p in params.values():
                    p.grad = torch.randn(p.shape, generator=g).to(device)
                opt.reduce_gradients()
                opt.step()
            on = {st.local.device.type for e in opt.entries for st in (e.master, *e.state.values())}
            moved = all(not torch.equal(before[k], p.detach()) for k, p in params.items())
            finite = all(bool(torch.isfinite(p).all()) for p in params.values())
            yield {"part": "roundtrip", "what": f"ShardedOptimizer {compute_copy} on {device.type} "
                   f"({dist.get_backend()}), 3 steps", "value": f"state on {sorted(on)}, updated, finite",
                   "ok": on == {device.type} and moved and finite}
        dist.destroy_process_group()


def part_mxfp8(device: torch.device, small: bool = False) -> Iterator[dict]:
    from flexshard.mxfp8 import dequantize, quantize

    n = 256 if small else 8192
    x = torch.randn(n, n, device=device)
    cast = timed(lambda: x.to(torch.bfloat16), device, repeat=3 if small else 20)
    for blocks in ("row", "column", "tile"):
        q = timed(lambda: quantize(x, 32, blocks), device, repeat=3 if small else 20)
        mx, ref = quantize(x, 32, blocks), quantize(x.cpu(), 32, blocks)  # the device path against the CPU's
        same = torch.equal(mx.scale.cpu(), ref.scale) and torch.equal(mx.data.cpu().view(torch.uint8), ref.data.view(torch.uint8))
        back = torch.equal(dequantize(mx).cpu(), dequantize(ref))
        yield {"part": "mxfp8", "what": f"quantize {n}x{n} fp32, {blocks} blocks (ms; bits as on the CPU: {same and back})",
               "value": round(q * 1e3, 3), "against": f"bf16 cast {cast * 1e3:.3f} ms", "ratio": q / cast, "ok": same and back,
               "gbps": round(x.numel() * 4 / q / GB, 1)}


def gpu_state(total_bytes: int, device: torch.device, tensors: int = 32) -> dict[str, torch.Tensor]:
    per = total_bytes // tensors // 4
    return {f"t{i:02d}": torch.randn(per, device=device) for i in range(tensors)}


def part_staging(device: torch.device, small: bool = False) -> Iterator[dict]:
    from flexckpt.format.write_plan import make_write_plan
    from flexckpt.save.staging import StagingBuffer, copies_for
    from flexckpt.state.structure import walk

    total = (8 << 20) if small else (2 << 30)
    state = gpu_state(total, device)
    w = walk(state, 0, 1)
    write_plan = make_write_plan(w.specs, 1, 64 << 20)
    plan = write_plan.rank_plan(0)
    index = {s.name: i for i, s in enumerate(w.specs)}
    buf = StagingBuffer()
    pin = device.type == "cuda"
    buf.ensure(plan.nbytes, pin=pin)
    order = [index[write_plan.specs[p.spec_index].name] for p in plan.pieces]
    dsts = buf.views(1, plan, write_plan.specs, [tuple(w.tensors[i].shape) for i in order])
    srcs = [w.tensors[i] for i in order]
    copies = copies_for(device)
    stage = timed(lambda: copies.copy(dsts, srcs, copies.ready()), device, repeat=5)
    flat = torch.randn(total // 4, device=device)
    host = torch.empty(total // 4, pin_memory=pin)
    plain = timed(lambda: host.copy_(flat), device, repeat=5)
    gbps, limit = total / stage / GB, total / plain / GB
    yield {"part": "staging", "what": f"device-to-host staging of {total / GB:.2f} GB in {len(srcs)} tensors (GB/s)",
           "value": round(gbps, 2), "against": f"plain copy_ into pinned {limit:.2f} GB/s", "ratio": gbps / limit,
           "ok": all(torch.equal(d.view(-1)[:8].cpu(), s.view(-1)[:8].cpu()) for d, s in zip(dsts, srcs))}


class _FlexWait:
    name = "flexckpt"

    def __init__(self, root: str, state: dict) -> None:
        from flexckpt import Checkpointer

        self.state, self.ckpt, self.h = state, Checkpointer(root, keep_last=1, max_in_flight=1, fsync=False), None

    def save(self, step: int) -> None:
        self.h = self.ckpt.save(step, self.state)

    def fence(self) -> None:
        self.h.wait_staged()

    def close(self) -> None:
        self.ckpt.close()


class _DcpWait:
    name = "DCP async_save, pinned async stager"

    def __init__(self, root: str, state: dict) -> None:
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.dcp, self.root, self.state = dcp, root, state
        self.pg = dist.new_group(backend="gloo")
        self.stager = DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False,
                                                   use_async_staging=True, use_non_blocking_copy=True))
        self.upload, self.resp, self.prev = None, None, None

    def save(self, step: int) -> None:
        if self.upload is not None:
            self.upload.result()
            shutil.rmtree(os.path.join(self.root, f"step-{self.prev}"), ignore_errors=True)
        writer = self.dcp.FileSystemWriter(os.path.join(self.root, f"step-{step}"), sync_files=False)
        self.resp = self.dcp.async_save(self.state, storage_writer=writer, process_group=self.pg, async_stager=self.stager)
        self.upload, self.prev = getattr(self.resp, "upload_completion", self.resp), step

    def fence(self) -> None:
        staging = getattr(self.resp, "staging_completion", None)
        if staging is not None:
            staging.result()

    def close(self) -> None:
        if self.upload is not None:
            self.upload.result()
        self.stager.close()


class _TcWait:
    name = "torch_checkpointing, pinned staging"

    def __init__(self, root: str, state: dict) -> None:
        from torch_checkpointing import CheckpointManager
        from torch_checkpointing.config import AsyncCheckpointSaverConfig
        from torch_checkpointing.staging import CheckpointStagerConfig
        from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

        cfg = CheckpointManager.Config(
            save=AsyncCheckpointSaverConfig(staging_config=CheckpointStagerConfig(use_pinned_memory=True,
                                                                                  use_non_blocking_copy=True)),
            storage_config=LocalFileSystemStorageConfig(use_direct_io=False))
        self.root, self.state, self.m, self.fut, self.prev, self.lock = root, state, cfg.build(), None, None, None
        self.m._saver._checkpoint_process.wait_for_init()

    def save(self, step: int) -> None:
        if self.fut is not None:
            self.fut.result()
            shutil.rmtree(os.path.join(self.root, f"step-{self.prev}"), ignore_errors=True)
        self.fut, self.prev = self.m.save(os.path.join(self.root, f"step-{step}"), {"model": self.state}), step

    def fence(self) -> None:
        self.lock = self.m.lock()
        self.lock.__enter__()

    def after_step(self) -> None:
        if self.lock is not None:
            self.lock.__exit__(None, None, None)
            self.lock = None

    def close(self) -> None:
        if self.fut is not None:
            self.fut.result()
        self.m.close()


def trainer_waits(saver: Any, state: dict, device: torch.device, steps: int, every: int, work: Callable[[], None]) -> list[float]:
    """Seconds the training thread spends in save() + at the fence, per checkpoint: the
    step's work, save after it, the fence before the next optimizer update (which changes
    the state: here every tensor gets += 0)."""
    waits: list[float] = []
    pending = False
    for step in range(1, steps + 1):
        work()
        wait = 0.0
        if pending:
            t0 = time.perf_counter()
            saver.fence()
            wait += time.perf_counter() - t0
        torch._foreach_add_(list(state.values()), 0.0)  # the optimizer update
        if hasattr(saver, "after_step"):
            saver.after_step()
        if pending:
            waits[-1] += wait
            pending = False
        if step % every == 0:
            sync(device)
            t0 = time.perf_counter()
            saver.save(step)
            waits.append(time.perf_counter() - t0)
            pending = True
    if pending:
        t0 = time.perf_counter()
        saver.fence()
        waits[-1] += time.perf_counter() - t0
        if hasattr(saver, "after_step"):
            saver.after_step()
    return waits


def part_wait(device: torch.device, small: bool = False, libs: tuple = ("flexckpt", "dcp", "tc")) -> Iterator[dict]:
    total = (8 << 20) if small else (2 << 30)
    steps, every = (6, 3) if small else (12, 3)
    a = torch.randn(4096, 4096, device=device) if not small else torch.randn(64, 64)

    def work() -> None:  # a step: fp32 matrix products, about 0.3 s on an H200 (a few ms on the CPU, small)
        for _ in range(1 if small else 150):
            torch.mm(a, a)
        sync(device)

    makers = {"flexckpt": _FlexWait, "dcp": _DcpWait, "tc": _TcWait}
    results: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(dir=os.environ.get("GPU_CHECK_TMP")) as tmp:
        one_rank_group(device, tmp)
        for lib in libs:
            state = gpu_state(total, device)
            root = os.path.join(tmp, lib)
            os.makedirs(root)
            try:
                saver = makers[lib](root, state)
            except Exception as e:  # noqa: BLE001 - a peer missing on this machine is a row, not a crash
                yield {"part": "wait", "what": f"{lib}: unavailable", "value": f"{type(e).__name__}: {e}"[:200], "ok": None}
                continue
            try:
                waits = trainer_waits(saver, state, device, steps, every, work)
            finally:
                saver.close()
            results[lib] = waits
            del state
            shutil.rmtree(root, ignore_errors=True)
    ref = results.get("flexckpt")
    for lib, waits in results.items():
        p99 = float(torch.tensor(waits).quantile(0.99))
        row = {"part": "wait", "what": f"trainer wait p99 per checkpoint, {total / GB:.2f} GB GPU state, "
               f"{len(waits)} saves: {makers[lib].name} (ms)", "value": round(p99 * 1e3, 2),
               "p50_ms": round(statistics.median(waits) * 1e3, 2)}
        if ref is not None and lib != "flexckpt":
            ref99 = float(torch.tensor(ref).quantile(0.99))
            row.update(against=f"flexckpt {ref99 * 1e3:.2f} ms", ratio=p99 / ref99 if ref99 else None)
        yield row
    import torch.distributed as dist

    dist.destroy_process_group()


def part_flextrain(device: torch.device, small: bool = False) -> Iterator[dict]:
    from flextrain.launch import env, metrics, train_command

    sets = ["steps=20", "ckpt_every=5", "eval_every=100", f"device={device.type}", "data.workers=2"]
    if small:  # the CPU check of this part's logic
        sets += ["data.max_length=64", "data.global_batch=8"]
    limit = 60 if device.type == "cuda" else 600
    with tempfile.TemporaryDirectory() as tmp:
        whole, cut = Path(tmp) / "whole", Path(tmp) / "cut"
        t0 = time.perf_counter()
        subprocess.run(train_command(1, whole, sets), env=env(), check=True, capture_output=True, timeout=limit)
        run_s = time.perf_counter() - t0
        proc = subprocess.Popen(train_command(1, cut, sets), env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        log = cut / "metrics.jsonl"
        while not (log.exists() and len(log.read_text().splitlines()) >= 11) and proc.poll() is None:
            time.sleep(0.005)
        ended = proc.poll() is not None
        proc.kill()
        proc.wait()
        killed_at = len(log.read_text().splitlines())
        if ended:
            raise RuntimeError(f"the run to kill ended by itself (exit {proc.returncode}) after {killed_at} steps")
        subprocess.run(train_command(1, cut, sets), env=env(), check=True, capture_output=True, timeout=limit)
        a, b = metrics(whole), metrics(cut)
        resumed = json.loads(next(cut.glob("resume-w1-r0.json")).read_text())["step"]
        later = range(resumed + 1, 21)
        same = [s for s in later if (a[s]["loss"], a[s]["global_batch_sha256"]) == (b[s]["loss"], b[s]["global_batch_sha256"])]
        yield {"part": "flextrain", "what": f"tiny on {device.type}, 20 steps ({run_s:.1f} s); killed after step {killed_at}, "
               f"resumed from step {resumed}", "value": f"{len(same)}/{len(later)} later steps bit-identical "
               f"(loss {a[20]['loss']:.6f})", "ok": len(same) == len(later) and len(later) > 0}


def _fanout_rank(rank: int, world: int, root: str) -> dict:
    """One rank of ``fanout``'s W=2 NCCL load: a replicated state (HSDP's replicate dim) saved
    from cuda:rank, loaded back into zeros there with ``fanout="nccl"``."""
    from flexckpt import Checkpointer
    from flexckpt.catalog import read_manifest

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    g = torch.Generator().manual_seed(29)
    full = {f"w{i}": torch.randn(1 << 22, generator=g) for i in range(4)}  # 64 MB, every rank all of it
    with Checkpointer(root) as ck:
        ck.save(1, {k: v.to(device) for k, v in full.items()}).result(120)
    target = {k: torch.zeros_like(v, device=device) for k, v in full.items()}
    with Checkpointer(root, fanout="nccl") as ck:
        t0 = time.perf_counter()
        ck.load(target, step=1)
        seconds = time.perf_counter() - t0
        s = ck.last_load_stats
    m = read_manifest(Checkpointer(root, read_only=True).storage, 1)
    return {"exact": all(torch.equal(target[k].cpu(), full[k]) for k in full), "seconds": seconds,
            "store": s.bytes_from_store - s.metadata_bytes, "peers": s.bytes_from_peers,
            "reread": s.peer_chunks_reread, "needed": sum(int(m.files[f].lengths.sum()) for f in m.files)}


def part_fanout(device: torch.device, small: bool = False) -> Iterator[dict]:
    from flexckpt.load.exchange import DeviceWire

    wire = DeviceWire(device)
    host = torch.randint(0, 256, (4 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(29))
    sent = wire.out(host)
    buf = wire.into(host)
    buf.copy_(sent)  # what NCCL's send and receive do between two GPUs
    back = torch.zeros_like(host)
    wire.landed(buf, back)
    yield {"part": "fanout", "what": f"device wire: a 4 MiB batch host -> {sent.device} -> host (W=1)",
           "value": "bit-exact" if torch.equal(back, host) else "differs",
           "ok": torch.equal(back, host) and sent.device == buf.device == device and back.device.type == "cpu"}
    if device.type != "cuda" or torch.cuda.device_count() < 2:
        yield {"part": "fanout", "what": "W=2 load with fanout='nccl'", "ok": None,
               "value": f"not run: {torch.cuda.device_count()} GPU(s) here; NCCL takes one a rank (needs 2+)"}
        return
    from flexshard.spawn import run_workers

    with tempfile.TemporaryDirectory(dir=os.environ.get("GPU_CHECK_TMP")) as tmp:
        got = run_workers(_fanout_rank, 2, os.path.join(tmp, "ckpt"), backend="nccl", timeout=TIMEOUTS["fanout"] - 2)
    needed = got[0]["needed"]
    ok = (all(r["exact"] and not r["reread"] for r in got) and sum(r["store"] for r in got) == needed
          and all(r["store"] + r["peers"] == needed for r in got))
    yield {"part": "fanout", "what": f"W=2 load with fanout='nccl' of a replicated {needed / 1e6:.0f} MB state: "
           f"store / peers bytes by rank {[(r['store'], r['peers']) for r in got]} "
           f"({max(r['seconds'] for r in got):.2f} s)", "value": "bit-exact" if all(r["exact"] for r in got)
           else "differs", "against": f"{needed} stored bytes, each read once", "ok": ok}


PARTS = {"roundtrip": part_roundtrip, "flextrain": part_flextrain, "staging": part_staging, "wait": part_wait,
         "mxfp8": part_mxfp8, "fanout": part_fanout}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=sorted(PARTS), help="run one part here, with no timeout")
    ap.add_argument("--parts", nargs="*", default=list(TIMEOUTS), help="parts to run (each in a child, with its timeout)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False); nothing to check, skipped")
        return 0
    out = out_dir()
    if args.part:
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        for row in PARTS[args.part](device):
            emit(row, out)
        return 0
    (out / "gpu_check.jsonl").unlink(missing_ok=True)
    emit({"part": "machine", "what": "device", "value": f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
          f"CUDA {torch.version.cuda}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}"}, out)
    return run_all(args.parts, out)


if __name__ == "__main__":
    sys.exit(main())
