"""Run a function on ``world_size`` fresh processes joined in a ``torch.distributed``
group, with a deadline: the tool that tests, demos and benchmarks share.

Rendezvous goes through a ``FileStore`` in a private temporary folder (no ports to race
for). A rank that raises fails the whole run with that rank's traceback; a rank that dies
or hangs past the deadline fails it too, and every other rank is killed.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import shutil
import tempfile
import time
import traceback
from typing import Any, Callable


class WorkerError(RuntimeError):
    """A rank failed; the message carries its traceback."""


def _worker(
    rank: int,
    world_size: int,
    store_path: str,
    backend: str,
    threads: int,
    fn: Callable[..., Any],
    args: tuple,
    results: "mp.Queue",
) -> None:
    try:
        import torch
        import torch.distributed as dist

        if threads:
            torch.set_num_threads(threads)
        os.environ["LOCAL_WORLD_SIZE"] = str(world_size)  # one node, as torchrun says it
        if backend != "none":
            store = dist.FileStore(store_path, world_size)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
        try:
            out = fn(rank, world_size, *args)
        finally:
            if backend != "none" and dist.is_initialized():
                dist.destroy_process_group()
        # Plain pickle, by value: torch's multiprocessing reductions would share tensors
        # through file descriptors that die with this process before the parent reads them.
        results.put(("ok", rank, pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        results.put(("error", rank, traceback.format_exc()))


def run_workers(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    backend: str = "gloo",
    threads_per_rank: int = 1,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes and return
    the results in rank order. ``fn`` and its results must be picklable (results travel
    by value, tensors included); ``backend="none"`` skips the process group (for code that
    must work without one)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = mp.get_context("spawn")
    tmp = tempfile.mkdtemp(prefix="flexshard-spawn-")
    store_path = os.path.join(tmp, "store")
    results: mp.Queue = ctx.Queue()
    old_env = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    procs = []
    try:
        for rank in range(world_size):
            p = ctx.Process(
                target=_worker,
                args=(rank, world_size, store_path, backend, threads_per_rank, fn, args, results),
                daemon=True,
            )
            p.start()
            procs.append(p)
        return _collect(procs, results, world_size, timeout)
    finally:
        for k, v in old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(5)
        results.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _collect(procs: list, results: "mp.Queue", world_size: int, timeout: float) -> list[Any]:
    deadline = time.monotonic() + timeout
    out: dict[int, Any] = {}
    while len(out) < world_size:
        left = deadline - time.monotonic()
        if left <= 0:
            missing = sorted(set(range(world_size)) - set(out))
            raise TimeoutError(f"ranks {missing} of {world_size} did not finish within {timeout:.0f} s")
        try:
            status, rank, value = results.get(timeout=min(left, 0.5))
        except queue.Empty:
            for rank, p in enumerate(procs):
                if rank not in out and not p.is_alive() and p.exitcode not in (0, None):
                    # give a just-posted result a moment to arrive before blaming the exit
                    try:
                        status, r2, value = results.get(timeout=1.0)
                    except queue.Empty:
                        raise WorkerError(f"rank {rank} died with exit code {p.exitcode} and no report")
                    if status == "error":
                        raise WorkerError(f"rank {r2} of {world_size} failed:\n{value}")
                    out[r2] = pickle.loads(value)
            continue
        if status == "error":
            raise WorkerError(f"rank {rank} of {world_size} failed:\n{value}")
        out[rank] = pickle.loads(value)
    return [out[r] for r in range(world_size)]
