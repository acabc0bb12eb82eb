"""The checkpoint libraries under test, each behind the same four calls the benchmark
loop makes, so every library sees the same state, storage and schedule:

    token = saver.save(step)    # the trainer's call (includes waiting for a save still in
                                # flight: every library keeps at most one); token["save_s"]
                                # is the time of the library's calls alone
    release = saver.fence(token)   # before the optimizer step; returns a callable to run
                                   # after it (torch_checkpointing's lock), or None
    saver.done_at(token)        # perf_counter() when this rank's part of the save finished
    saver.finish(); saver.verify(step, version); saver.close()

What each library's trainer wait is made of (time inside save() + time at the fence):

- ``dcp*``: ``dcp.async_save(...)`` after ``previous_upload.result()`` (one in flight, as
  torchtitan does). Without a stager, async_save stages synchronously, so the fence is
  empty; with ``DefaultStager(use_async_staging=True)`` the fence is
  ``response.staging_completion.result()``.
- ``torch_checkpointing``: ``CheckpointManager.save(...)`` (which itself waits for the
  previous write) and, as the fence, acquiring ``manager.lock()`` (the library's guard
  for the optimizer step; released after it). Its staging runs on its own thread.
- ``flexckpt``: ``Checkpointer.save(...)`` and ``handle.wait_staged()``.
- ``flexckpt-tier``: the same, plus ``Checkpointer.save_local(...)`` (the fast tier: node
  memory and a copy on a peer node, each rank an emulated node) every step, and its
  ``wait_staged()`` at the fence; a fast save due while the last is still copying is
  skipped (counted, never waited for).
"""
from __future__ import annotations

import functools
import os
import queue
import shutil
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from fsdp2_state import build_state
from harness import TensorSpec, mismatches, zeros_like_state

KEEP_LAST = 2  # checkpoints kept on disk while a run goes (every library the same)

# name -> (label, what the row adds); the DCP rows are cumulative.
VARIANTS: dict[str, str] = {
    "dcp": "dcp.async_save, defaults (thread executor, synchronous staging into a fresh copy)",
    "dcp-cache": "dcp + DefaultSavePlanner(enable_plan_caching=True)",
    "dcp-nocoll": "dcp-cache + use_collectives=False",
    "dcp-stager": "dcp-nocoll + async_stager=DefaultStager(StagingOptions(use_async_staging=True)), "
    "staging_completion waited before the optimizer step",
    "tc": "torch_checkpointing CheckpointManager, async saver (staging thread + writer subprocess)",
    "flexckpt": "flexckpt Checkpointer(max_in_flight=1, fsync=True)",
    "flexckpt-tier": "flexckpt + a fast-tier save every step (LocalTier in /dev/shm, each rank its own node, "
    "one copy on the next), fence on both saves' staging",
}
PEERS = ["dcp", "dcp-cache", "dcp-nocoll", "dcp-stager", "tc"]


def _step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step:06d}")


class _Retention:
    """Rank 0 removes checkpoints older than the newest ``KEEP_LAST`` on a background
    thread (flexckpt does its own retention, also off the training thread)."""

    def __init__(self, root: str, rank: int) -> None:
        self.root, self.rank = root, rank
        self._pool = ThreadPoolExecutor(max_workers=1) if rank == 0 else None

    def after_done(self, step: int) -> None:
        if self._pool is not None and step - KEEP_LAST >= 0:
            self._pool.submit(shutil.rmtree, _step_dir(self.root, step - KEEP_LAST), True)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def _stamp(fut: Future, box: list) -> None:
    fut.add_done_callback(lambda _f: box.append(time.perf_counter()))


# -- torch.distributed.checkpoint --------------------------------------------------------------
def clear_dcp_plan_caches() -> None:
    from torch.distributed.checkpoint.planner import SavePlanner

    for attr in ("_cached_save_plan", "_cached_final_save_plan", "_cached_all_plans", "_cached_global_plan", "_cached_metadata"):
        cache = getattr(SavePlanner, attr, None)
        if isinstance(cache, dict):
            cache.clear()


class DcpSaver:
    def __init__(self, variant: str, root: str, local: dict[str, torch.Tensor], specs: Sequence[TensorSpec], rank: int, world: int,
                 state_kind: str = "sharded") -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard

        self.name = variant
        self.dcp = dcp
        self.root, self.rank, self.world, self.specs = root, rank, world, specs
        self.plan_caching = variant in ("dcp-cache", "dcp-nocoll", "dcp-stager")
        self.collectives = variant not in ("dcp-nocoll", "dcp-stager")
        clear_dcp_plan_caches()
        # DCP's background thread runs collectives (plan exchange, final gather, or a
        # barrier without collectives); a group of their own keeps them from interleaving
        # with the trainer's all-reduce on the default group (torchtitan does the same).
        self.pg = dist.new_group(backend="gloo")
        self.mesh = init_device_mesh("cpu", (world,))
        self._dt = lambda t, s: DTensor.from_local(t, self.mesh, [Shard(0)], run_check=False, shape=torch.Size(s.global_shape), stride=_contiguous_stride(s.global_shape))
        self.state_kind = state_kind
        self.state = build_state(state_kind, local, specs, self._dt)
        self.local = local
        self.stager = (
            DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=False))
            if variant == "dcp-stager"
            else None
        )
        self._upload: Future | None = None
        self._prev_step: int | None = None
        self._retention = _Retention(root, rank)

    def _planner(self) -> Any:
        if not self.plan_caching:
            return None
        from torch.distributed.checkpoint import DefaultSavePlanner

        return DefaultSavePlanner(enable_plan_caching=True)

    def save(self, step: int) -> dict:
        t0 = time.perf_counter()
        if self._upload is not None:
            self._upload.result()  # at most one save in flight
        out = self.dcp.async_save(
            self.state,
            checkpoint_id=_step_dir(self.root, step),
            process_group=self.pg,
            planner=self._planner(),
            async_stager=self.stager,
            use_collectives=self.collectives,
        )
        save_s = time.perf_counter() - t0
        if self._prev_step is not None:
            self._retention.after_done(self._prev_step)
        staging = getattr(out, "staging_completion", None)
        upload = getattr(out, "upload_completion", out)
        token = {"t0": t0, "save_s": save_s, "staging": staging, "done": []}
        _stamp(upload, token["done"])
        self._upload, self._prev_step = upload, step
        return token

    def fence(self, token: dict) -> None:
        if token["staging"] is not None:
            token["staging"].result()
        return None

    def done_at(self, token: dict) -> float | None:
        return token["done"][0] if token["done"] else None

    def timings(self, token: dict) -> dict[str, float]:
        return {}

    def finish(self) -> None:
        if self._upload is not None:
            self._upload.result()
        self._retention.close()

    def verify(self, step: int, version: int) -> list[str]:
        fresh = zeros_like_state(self.local)
        target = build_state(self.state_kind, fresh, self.specs, self._dt)
        self.dcp.load(target, checkpoint_id=_step_dir(self.root, step), process_group=self.pg)
        return mismatches(fresh, self.specs, self.rank, self.world, version)

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()


def _dtensor_wrap(world: int) -> Callable[[torch.Tensor, TensorSpec], Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    return lambda t, s: DTensor.from_local(t, mesh, [Shard(0)], run_check=False, shape=torch.Size(s.global_shape),
                                           stride=_contiguous_stride(s.global_shape))


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(stride))


# -- torch_checkpointing -----------------------------------------------------------------------
def fsync_rank_files(args: Any, rank: int) -> None:
    """torch_checkpointing's writer never fsyncs; this pre-finalize callback makes this
    rank's files (and rank 0's metadata) durable before the commit, as DCP and flexckpt
    do, so all three write the same way."""
    folder = args.path
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            continue
        mine = name.endswith(f"_{rank}.pt") or (rank == 0 and not name.endswith(".pt"))
        if mine:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class TcSaver:
    name = "tc"

    def __init__(self, variant: str, root: str, local: dict[str, torch.Tensor], specs: Sequence[TensorSpec], rank: int, world: int, fsync: bool = True) -> None:
        import multiprocessing

        from torch_checkpointing import CheckpointManager
        from torch_checkpointing.config import AsyncCheckpointSaverConfig
        from torch_checkpointing.staging import CheckpointStagerConfig
        from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

        # run_workers' ranks are daemonic processes, and multiprocessing refuses children
        # of daemonic processes; torch_checkpointing writes from a child process.
        multiprocessing.current_process()._config["daemon"] = False
        self.root, self.rank, self.world, self.specs, self.local = root, rank, world, specs, local
        cfg = CheckpointManager.Config(
            save=AsyncCheckpointSaverConfig(
                staging_config=CheckpointStagerConfig(use_pinned_memory=False, use_non_blocking_copy=False),
            ),
            storage_config=LocalFileSystemStorageConfig(use_direct_io=False),
            pre_finalize_callback=functools.partial(fsync_rank_files, rank=rank) if fsync else None,
        )
        self.m = cfg.build()
        # the writer subprocess starts at construction; let it come up before the clock starts
        self.m._saver._checkpoint_process.wait_for_init()
        self._retention = _Retention(root, rank)
        self._last: tuple[int, Future] | None = None

    def save(self, step: int) -> dict:
        t0 = time.perf_counter()
        fut = self.m.save(_step_dir(self.root, step), {"model": self.local})  # waits for the previous write
        save_s = time.perf_counter() - t0
        if self._last is not None:
            self._retention.after_done(self._last[0])
        token = {"t0": t0, "save_s": save_s, "done": []}
        if fut is not None:
            _stamp(fut, token["done"])
            self._last = (step, fut)
        return token

    def fence(self, token: dict) -> Callable[[], None]:
        lock = self.m.lock()
        lock.__enter__()
        return lambda: lock.__exit__(None, None, None)

    def done_at(self, token: dict) -> float | None:
        return token["done"][0] if token["done"] else None

    def timings(self, token: dict) -> dict[str, float]:
        return {}

    def finish(self) -> None:
        if self._last is not None:
            self._last[1].result()
        self._retention.close()

    def verify(self, step: int, version: int) -> list[str]:
        fresh = zeros_like_state(self.local)
        out = self.m.load(_step_dir(self.root, step), into={"model": fresh})
        loaded = out["model"] if isinstance(out, dict) or hasattr(out, "__getitem__") else fresh
        return mismatches(dict(loaded), self.specs, self.rank, self.world, version)

    def close(self) -> None:
        self.m.close()


# -- flexckpt ----------------------------------------------------------------------------------
class _Timers:
    """``--profile``: wall time inside chosen flexckpt functions, summed per thread name.
    Wraps module attributes of this process only; flexckpt's source is untouched."""

    def __init__(self) -> None:
        self.total: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._lock = threading.Lock()

    def wrap(self, owner: Any, attr: str, label: str) -> None:
        fn = getattr(owner, attr)

        @functools.wraps(fn)
        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                dt = time.perf_counter() - t0
                key = f"{label} [{threading.current_thread().name.split('-')[1] if '-' in threading.current_thread().name else 'trainer'}]"
                with self._lock:
                    self.total[key] = self.total.get(key, 0.0) + dt
                    self.calls[key] = self.calls.get(key, 0) + 1

        setattr(owner, attr, timed)


def _install_profile() -> _Timers:
    import flexckpt.committer as committer
    import flexckpt.save_pipeline as pipeline
    import flexckpt.staging as stg
    import flexckpt.writer as wr

    timers = _Timers()
    timers.wrap(pipeline, "walk", "walk(state)")
    timers.wrap(pipeline.SavePipeline, "plan_for", "plan lookup")
    timers.wrap(stg.BufferPool, "acquire", "buffer acquire (waits while max_in_flight are busy)")
    timers.wrap(stg.HostCopies, "copy", "stage copy")
    timers.wrap(stg.StreamCopies, "copy", "stage copy (device)")
    timers.wrap(wr, "checksum", "checksum")
    timers.wrap(wr, "compress", "compress (none: slicing)")
    timers.wrap(os, "write", "os.write")
    timers.wrap(os, "fsync", "os.fsync")
    timers.wrap(committer, "gather", "commit: gather records")
    return timers


class FlexSaver:
    name = "flexckpt"

    def __init__(self, variant: str, root: str, local: dict[str, torch.Tensor], specs: Sequence[TensorSpec], rank: int, world: int,
                 profile: bool = False, state_kind: str = "sharded", **options: Any) -> None:
        from flexckpt import Checkpointer
        from flexckpt.tier import LocalTier
        from flexshard import Shard, ShardedTensor

        self.fast = variant == "flexckpt-tier"
        if self.fast:  # every rank its own emulated node; the tier's folders beside the run's, in /dev/shm
            os.environ["FLEXCKPT_NODE"] = f"n{rank}"
            options["local"] = LocalTier(dir=os.path.join("/dev/shm", f"flexckpt-bench-{os.path.basename(root)}", "{node}"),
                                         every=1, replicas=1, keep_last=2, timeout=120, lineage=root)

        self.profile = _install_profile() if profile else None

        self.root, self.rank, self.world, self.specs, self.local = root, rank, world, specs, local
        self._st = lambda t, s: ShardedTensor(t, Shard(0), s.global_shape, rank, world)
        if state_kind == "fsdp2":  # the same DTensors DCP saves (flexckpt maps them to Shard(0))
            self._st = _dtensor_wrap(world)
        self.state_kind = state_kind
        self.state = build_state(state_kind, local, specs, self._st)
        self.ckpt = Checkpointer(root, keep_last=KEEP_LAST, max_in_flight=1, fsync=True, **options)
        # SaveHandle has no done-callback: one parked thread stamps when each save's part on
        # this rank is done (waiting on the handle's event; it does no work of its own)
        self._watch: "queue.Queue" = queue.Queue()
        self._watcher = threading.Thread(target=self._stamp_loop, daemon=True)
        self._watcher.start()

    def _stamp_loop(self) -> None:
        while True:
            token = self._watch.get()
            if token is None:
                return
            token["h"]._done.wait()
            token["done"].append(time.perf_counter())

    def save(self, step: int) -> dict:
        t0, c0 = time.perf_counter(), time.thread_time()
        h = self.ckpt.save(step, self.state)
        hf = self.ckpt.save_local(step, self.state) if self.fast else None  # None: skipped, the last still copying
        token = {"t0": t0, "save_s": time.perf_counter() - t0, "h": h, "hf": hf, "done": [],
                 "save_cpu_s": time.thread_time() - c0}  # the training thread's own CPU time in the calls
        self._watch.put(token)
        return token

    def fence(self, token: dict) -> None:
        token["h"].wait_staged()
        if token["hf"] is not None:
            token["hf"].wait_staged()
        return None

    def done_at(self, token: dict) -> float | None:
        return token["done"][0] if token["done"] else None

    def timings(self, token: dict) -> dict[str, float]:
        h = token["h"]
        out = {"save_s": h.save_seconds, "fence_s": h.fence_seconds, **h.timings, "save_cpu_s": token["save_cpu_s"]}
        if self.fast:  # the fast save's own phases (its tier thread), 0 when skipped
            hf = token["hf"]
            out["fast_skipped"] = float(hf is None)
            for k in ("stage_s", "write_s", "replicate_s"):
                out["fast_" + k] = hf.timings.get(k, 0.0) if hf is not None and hf.done() else 0.0
        return out

    def profile_totals(self) -> dict[str, tuple[float, int]]:
        if self.profile is None:
            return {}
        return {k: (v, self.profile.calls[k]) for k, v in self.profile.total.items()}

    def finish(self) -> None:
        self.ckpt.wait()
        if self.fast:
            self.ckpt.tier.wait()
        self._watch.put(None)
        self._watcher.join(10)

    def verify(self, step: int, version: int) -> list[str]:
        fresh = zeros_like_state(self.local)
        target = build_state(self.state_kind, fresh, self.specs, self._st)
        self.ckpt.load(target, step=step)
        return mismatches(fresh, self.specs, self.rank, self.world, version)

    def close(self) -> None:
        self.ckpt.close()
        if self.fast:  # the emulated node's folder (the tier's own went at close)
            node = os.path.dirname(self.ckpt.tier.root)
            shutil.rmtree(node, ignore_errors=True)
            try:
                os.rmdir(os.path.dirname(node))
            except OSError:
                pass  # the other rank's node is still there


def make_saver(variant: str, root: str, local: dict[str, torch.Tensor], specs: Sequence[TensorSpec], rank: int, world: int,
               flex_options: dict | None = None, state_kind: str = "sharded") -> Any:
    if variant.startswith("dcp"):
        return DcpSaver(variant, root, local, specs, rank, world, state_kind)
    if variant == "tc":
        if state_kind != "sharded":
            raise ValueError(f"the torch_checkpointing saver has no {state_kind!r} state; use --libs without tc")
        return TcSaver(variant, root, local, specs, rank, world)
    if variant in ("flexckpt", "flexckpt-tier"):
        return FlexSaver(variant, root, local, specs, rank, world, state_kind=state_kind, **(flex_options or {}))
    raise ValueError(f"unknown library {variant!r}; expected one of {', '.join(VARIANTS)}")
