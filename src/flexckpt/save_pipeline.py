"""The save pipeline: what a persistent save takes on the training thread, and the threads
that carry it to storage.

``SavePipeline.save`` walks and plans the state (``plan_for``, cached while the state's
structure stays the same), captures its sources and values (``capture``), takes a staging
buffer and queues a ``SaveJob``. Threads (started on the first save), one queue between each:
  stager  - copies this rank's pieces into the staging buffer, then releases the fence;
  writer  - chunks, compresses, checksums and writes the rank's file and chunk table, then
            hands the job to the committer (:mod:`flexckpt.committer`): a group leader
            queues it for its commit thread, another rank writes its record;
  commit  - group leaders: ``Committer.commit``.
Each thread holds the pipeline (or the committer), never the ``Checkpointer``; ``abandon``
(the finalizer of a Checkpointer dropped without close()) stops them. No thread ever enters
a collective on the save path.

The fast tier stages through the same pipeline (``share_staged``, ``plan_for``, ``capture``,
``release``): those four methods are the seam it uses.
"""
from __future__ import annotations

import atexit
import functools
import queue
import threading
import time
from typing import Any, Callable

import orjson
import torch

from flexckpt.committer import Committer
from flexckpt.errors import SaveError
from flexckpt.handle import InFlight, SaveHandle
from flexckpt.names import GROUP, attempt_id, data_name, step_dir
from flexckpt.plan import make_write_plan, part_of_world
from flexckpt.save_job import PlanEntry, SaveJob, SaveSettings
from flexckpt.staging import BufferPool, StagingBuffer, copies_for, staging_device
from flexckpt.storage import makedirs
from flexckpt.structure import Walk, fingerprint, walk
from flexckpt.writer import RawSums, encode_per_rank, write_data_file, write_rank_files
from flexshard import part_of

__all__ = ["Attempts", "PlanEntry", "SaveJob", "SavePipeline"]


class Attempts:
    """Every rank numbers its saves of a step alike: attempt k of step s is the same save
    on every rank, and its files, records and markers are its own. Both tiers number their
    saves here, each with its own count (a persistent and a fast save of one step are both
    attempt 1)."""

    def __init__(self, run_id: str, session: str) -> None:
        self.run_id, self.session = run_id, session
        self._counts: dict[int, int] = {}

    def next(self, step: int) -> str:
        n = self._counts[step] = self._counts.get(step, 0) + 1
        return attempt_id(self.run_id, self.session, n)


class SavePipeline:
    """This rank's persistent saves from the call to the committer: the plan cache, the
    capture, the staging buffers and copies, and the stager and writer threads (and the
    commit thread of a group leader, which runs ``committer.commit``)."""

    def __init__(self, settings: SaveSettings, committer: Committer, in_flight: InFlight, max_in_flight: int) -> None:
        self.settings = settings
        self.storage = settings.storage
        self.rank, self.world_size = settings.rank, settings.world_size
        self.is_leader = self.rank % GROUP == 0  # gathers its group's records (rank 0: everyone's)
        self.committer = committer
        self.in_flight = in_flight
        self.pool = BufferPool(max_in_flight)
        self.attempts = Attempts(settings.run_id, settings.session)
        self._plan_key: list | None = None
        self._plan_entry: PlanEntry | None = None
        self._plan_ids = 0
        self._copies: dict[torch.device, Any] = {}  # staging copies by device (copies_for)
        self._stage_q: queue.Queue = queue.Queue()
        self._write_q: queue.Queue = queue.Queue()
        self._commit_q: queue.Queue = queue.Queue()
        self._threads: list[threading.Thread] = []
        self._dropped = threading.Event()  # its Checkpointer was freed without close()
        self._lock = threading.Lock()
        self._last_save: SaveJob | None = None

    # -- on the calling thread -------------------------------------------------------------------
    def save(self, step: int, state: dict) -> SaveHandle:
        """Walk, plan and capture ``state``, take a staging buffer (waiting while
        max_in_flight saves are staged but not written) and queue the save; its handle."""
        s = self.settings
        w = walk(state, self.rank, self.world_size)
        entry = self.plan_for(w)
        srcs, plain, lanes, per_rank = self.capture(w, entry)
        attempt = self.attempts.next(step)  # the same save on every rank (see Attempts)
        waiter = None if s.is_coordinator else functools.partial(self.committer.wait_for_commit, attempt=attempt)
        handle = SaveHandle(step, waiter, attempt)
        copies = self._copies.get(entry.device)
        if copies is None:
            copies = self._copies[entry.device] = copies_for(entry.device)
        ready = copies.ready()  # an event on the training stream; the copies run on the staging thread
        self._ensure_threads()
        t_wait = time.perf_counter()
        buffer = self.pool.acquire()  # waits while max_in_flight saves are staged but not written
        handle.timings["buffer_wait_s"] = time.perf_counter() - t_wait
        job = SaveJob(step, handle, entry, buffer, srcs, plain, lanes, per_rank, ready, attempt, keyed=dict(w.keyed),
                      lease=buffer.lease, state=state,
                      sums=RawSums() if s.compression.codec == "none" else None,
                      tree=w.tree if s.is_coordinator else None)
        self.in_flight.add(handle)
        with self._lock:
            self._last_save = job  # a fast save of the same step and state takes its bytes (share_staged)
        self._stage_q.put(job)
        return handle

    def plan_for(self, w: Walk) -> PlanEntry:
        """The plan of the walked state's structure on this rank (the last one, while the
        structure stays the same)."""
        if w.key == self._plan_key and self._plan_entry is not None:
            return self._plan_entry
        structure = w.structure_json()
        plan = make_write_plan(w.specs, self.world_size, self.settings.chunk_bytes)
        rank_plan = plan.rank_plan(self.rank)
        walk_index = {s.name: i for i, s in enumerate(w.specs)}
        order = [walk_index[plan.specs[p.spec_index].name] for p in rank_plan.pieces]
        # a piece this rank writes only part of (HybridShard: the replicas share the writing)
        parts: list[tuple[int, int] | None] = []
        for p, i in zip(rank_plan.pieces, order):
            spec = w.specs[i]
            held = part_of(spec.layout, spec.shape, self.world_size, self.rank)
            parts.append(None if (p.start, p.stop) == (held.start, held.stop) else (p.start - held.start, p.stop - held.start))
        self._plan_ids += 1
        entry = PlanEntry(
            id=self._plan_ids,
            plan=plan,
            rank_plan=rank_plan,
            fingerprint=fingerprint(structure),
            structure=structure,
            structure_bytes=orjson.dumps(structure),
            order=order,
            shapes=[tuple(w.tensors[i].shape) if part is None else (part[1] - part[0],) for i, part in zip(order, parts)],
            parts=parts,
            device=staging_device({w.tensors[i].device for i in order}),
            per_rank_keys=sorted(w.per_rank),
            partial=any(part_of_world(s.layout, self.world_size) for s in plan.specs),
        )
        self._plan_key, self._plan_entry = w.key, entry
        return entry

    def capture(self, w: Walk, entry: PlanEntry) -> tuple[list, dict, dict, dict]:
        """What a save takes on the calling thread: the source of each piece this rank
        writes, and the plain (the coordinator's), per-lane and per-rank values encoded now
        (the pipeline moves on after the call)."""
        srcs = [w.tensors[i] if part is None else w.tensors[i].reshape(-1)[part[0] : part[1]]
                for i, part in zip(entry.order, entry.parts)]
        plain = dict(w.plain_json) if self.settings.is_coordinator else {}  # encoded by the walk
        lanes = {k: orjson.dumps(v.values) for k, v in w.lanes.items()}
        per_rank = {k: orjson.dumps(encode_per_rank(v.value)) for k, v in w.per_rank.items()}
        return srcs, plain, lanes, per_rank

    def share_staged(self, step: int, state: dict) -> SaveJob | None:
        """The last ``save()``'s job when it saved ``step`` from this very ``state`` object
        and its buffer still holds that save: the buffer then has one more holder (the
        fast tier, which gives it back with :meth:`release` once it has copied the bytes;
        the next staging into the buffer waits for that). None otherwise."""
        with self._lock:
            job = self._last_save
        if job is None or job.step != step or job.state is not state:
            return None
        return job if self.pool.share(job.buffer, job.lease) else None

    def release(self, buffer: StagingBuffer) -> None:
        """Give back one hold on a staging buffer (a writer's, or a fast save's share)."""
        self.pool.release(buffer)

    # -- waiting and stopping ------------------------------------------------------------------
    def wait(self, timeout: float | None = None) -> None:
        """Every save started so far finished on this rank, retention after the last commit
        included (errors stay on their handles)."""
        self.in_flight.wait(timeout)
        if self.settings.is_coordinator and self._threads:
            self._commit_q.join()  # retention of the last commit, too

    def finish(self, timeout: float | None = None) -> None:
        """Let the saves queued so far finish, then end the threads (``close()``)."""
        if self._threads:
            self._stage_q.put(None)
            deadline = None if timeout is None else time.monotonic() + timeout
            for t in self._threads:
                t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        self._threads = []

    def clear(self) -> None:
        """Drop the staging buffers (after ``finish`` and the fast tier's close)."""
        self._last_save = None
        self.pool.clear()

    def abandon(self) -> None:
        """End the threads without finishing the saves in flight: each fails on its handle
        at its next stage (the Checkpointer was freed without close())."""
        self._dropped.set()
        self._stage_q.put(None)

    # -- the threads -----------------------------------------------------------------------------
    def _ensure_threads(self) -> None:
        with self._lock:  # two threads' first saves must start one set of threads, not two
            if self._threads:
                return
            loops: list[tuple[str, Callable[[SaveJob], None], queue.Queue, queue.Queue | None]] = [
                ("stage", self._stage, self._stage_q, self._write_q),
                ("write", self._write, self._write_q, self._commit_q),
            ]
            if self.is_leader:
                loops.append(("commit", self.committer.commit, self._commit_q, None))
            for name, work, inbox, outbox in loops:
                t = threading.Thread(target=serve, args=(work, inbox, outbox, self._dropped),
                                     name=f"flexckpt-{name}-r{self.rank}", daemon=True)
                t.start()
                self._threads.append(t)

    def _stage(self, job: SaveJob) -> None:
        """The stager: this rank's pieces into the job's staging buffer, then the fence."""
        delay = self.settings.stage_delay
        if delay:
            # let every rank leave save() before this copy takes a core and memory
            # bandwidth; a fence that arrives first cuts the pause short
            job.handle._fence_called.wait(delay)
        t0 = time.perf_counter()
        try:
            e = job.entry
            job.buffer.ensure(e.rank_plan.nbytes, pin=e.device.type == "cuda")
            dsts = job.buffer.views(e.id, e.rank_plan, e.plan.specs, e.shapes)
            self._copies[e.device].copy(dsts, job.srcs, job.ready)
        except BaseException as exc:  # noqa: BLE001 - reported on the handle
            self.pool.release(job.buffer)
            job.state = None
            self.committer.report_failure(job, exc, "staging")
            return
        finally:
            job.srcs = None  # the state is the caller's again
        job.handle.timings["stage_s"] = time.perf_counter() - t0
        job.staged_ok = True
        job.handle._staged.set()
        self._write_q.put(job)

    def _write(self, job: SaveJob) -> None:
        """The writer: the rank's data file and chunk table (and values), then the committer."""
        s = self.settings
        t0 = time.perf_counter()
        try:
            e = job.entry
            rank_plan = e.rank_plan
            folder = f"{step_dir(job.step)}/{job.attempt}"
            # and another rank's retention (a process) may rmdir the empty step folder
            with self.committer.folders_lock:
                makedirs(self.storage, folder)
            if rank_plan.nbytes:
                job.chunks = write_data_file(
                    self.storage, f"{step_dir(job.step)}/{data_name(job.attempt, self.rank)}",
                    memoryview(job.buffer.data.numpy()), rank_plan.nbytes,
                    rank_plan.chunks, s.compression, s.fsync, s.direct_io, job.sums,
                )
        except BaseException as exc:  # noqa: BLE001
            self.committer.report_failure(job, exc, "writing")
            return
        finally:
            self.pool.release(job.buffer)
            job.state = None  # no fast save can share the buffer now
        try:
            job.line = write_rank_files(
                self.storage, step_dir(job.step), rank=self.rank, attempt=job.attempt, fingerprint=e.fingerprint,
                codec=s.compression.codec, chunks=job.chunks, per_rank=job.per_rank, fsync=s.fsync,
            ).line
        except BaseException as exc:  # noqa: BLE001
            self.committer.report_failure(job, exc, "writing its chunk table")
            return
        job.handle.timings["write_s"] = time.perf_counter() - t0
        job.handle.timings["bytes"] = float(rank_plan.nbytes)
        if self.is_leader:
            self._commit_q.put(job)
        else:
            self.committer.hand_in(job)


def serve(work: Callable[[Any], None], inbox: queue.Queue, outbox: queue.Queue | None,
          dropped: threading.Event) -> None:
    """A background thread: hand each job from ``inbox`` to ``work``. None (from ``finish``
    or ``abandon``, after every job queued before it) stops it and is passed down the line;
    once ``dropped`` is set, the jobs that reach it fail on their handles instead: their
    ``result()`` would otherwise wait for ever."""
    while True:
        job = inbox.get()
        try:
            if job is None:
                if outbox is not None:
                    outbox.put(None)
                return
            if dropped.is_set():
                job.handle._fail(SaveError(DROPPED))
            else:
                work(job)
        finally:
            job = None  # hold nothing while waiting for the next job
            inbox.task_done()


DROPPED = ("the Checkpointer was freed without close() before this save finished; keep a reference to it and call "
           "close() (or use it in a with block) to finish its saves")


def stop_on_collect(pipeline: SavePipeline, at_exit: Any) -> None:
    """The finalizer of a Checkpointer dropped without close(): its at-exit close goes, and
    its pipeline's threads end."""
    atexit.unregister(at_exit)
    pipeline.abandon()
