"""The save pipeline: what a save takes on the training thread, and the threads that
carry it to storage.

A save is walked and planned on the training thread (``plan_for``, cached while the
state's structure stays the same), its sources and values captured (``capture``), and
queued as a ``SaveJob``. Threads (started on the first save), one queue between each:
  stager  - copies this rank's pieces into a staging buffer, then releases the fence;
  writer  - chunks, compresses, checksums and writes the rank's file, then its record
            (a group leader hands the job to its commit thread instead);
  commit  - group leaders: the commit side, :mod:`flexckpt.committer`.
No thread ever enters a collective on the save path.
"""
from __future__ import annotations

import atexit
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import orjson
import torch

from flexckpt.commit import keyed_entries, record_doc
from flexckpt.errors import SaveError
from flexckpt.handle import SaveHandle
from flexckpt.names import (
    GROUP,
    attempt_id,
    committed_name,
    data_name,
    record_name,
    step_dir,
)
from flexckpt.plan import RankPlan, WritePlan, make_write_plan, part_of_world
from flexckpt.staging import StagingBuffer, staging_device
from flexckpt.storage import makedirs
from flexckpt.structure import Walk, fingerprint
from flexckpt.writer import RawSums, encode_per_rank, write_data_file, write_rank_files
from flexshard import part_of


@dataclass(eq=False)
class PlanEntry:
    """A state structure's plan on this rank, kept while the structure stays the same."""

    id: int
    plan: WritePlan
    rank_plan: RankPlan
    fingerprint: str
    structure: dict
    structure_bytes: bytes
    order: list[int]  # walk indices of this rank's pieces, in stream order
    shapes: list[tuple]
    device: torch.device  # staged from: the CPU or this rank's accelerator
    per_rank_keys: list[str] = field(default_factory=list)
    parts: list = field(default_factory=list)  # per piece: None (all of it) or (start, stop) of the local flat piece
    published: bool = False  # the structure went out in a record (the first save with it)
    partial: bool = False  # holds a tensor on a mesh spanning part of the world (a pipeline stage's)
    published_in: tuple | None = None  # (step, attempt) whose record carried the structure, until seen committed


@dataclass(eq=False)
class SaveJob:
    """One persistent save on its way through the stager, writer and commit threads."""

    step: int
    handle: SaveHandle
    entry: PlanEntry
    buffer: StagingBuffer
    srcs: list[torch.Tensor] | None
    plain: dict[str, Any]
    lanes: dict[str, bytes]
    per_rank: dict[str, bytes]
    ready: Any  # the copies' mark on the training stream (None on a CPU)
    attempt: str = ""
    keyed: dict[str, bytes] = field(default_factory=dict)  # this rank's bytes values, by key
    lease: int = 0  # the buffer's acquisition that holds this save (BufferPool.share)
    state_id: int = 0  # id() of the state saved: a fast save of the same step and state shares this one
    staged_ok: bool = False  # the buffer holds the state (set before the fence is released)
    sums: RawSums | None = None  # its chunk checksums, shared with a fast save of its bytes (uncompressed only)
    chunks: list = field(default_factory=list)
    line: list = field(default_factory=list)  # its record: [fingerprint, table checksum, table bytes, stored bytes,
    #                                           values checksum ("" without values), values bytes]
    tree: Any = None  # the coordinator's: the state's container tree, for the manifest (flexckpt.tree)


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
    """The save side of ``Checkpointer`` (a mixin: the queues, pool and locks it uses are
    made in ``Checkpointer.__init__``): planning and capture on the training thread, then
    the staging and writing threads."""

    def plan_for(self, w: Walk) -> PlanEntry:
        if w.key == self._plan_key and self._plan_entry is not None:
            return self._plan_entry
        structure = w.structure_json()
        plan = make_write_plan(w.specs, self.world_size, self.chunk_bytes)
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
        plain = dict(w.plain_json) if self.is_coordinator else {}  # encoded by the walk
        lanes = {k: orjson.dumps(v.values) for k, v in w.lanes.items()}
        per_rank = {k: orjson.dumps(encode_per_rank(v.value)) for k, v in w.per_rank.items()}
        return srcs, plain, lanes, per_rank

    def share_staged(self, step: int, state: dict) -> SaveJob | None:
        """The last ``save()``'s job when it saved ``step`` from this very ``state`` object
        and its buffer still holds that save: the buffer then has one more holder (the
        fast tier, which releases it once it has copied the bytes; the next staging into
        the buffer waits for that). None otherwise."""
        with self._lock:
            job = self._last_save
        if job is None or job.step != step or job.state_id != id(state):
            return None
        return job if self._pool.share(job.buffer, job.lease) else None

    def release(self, buffer: StagingBuffer) -> None:
        """Let go of a staging buffer :meth:`share_staged` handed out (once)."""
        self._pool.release(buffer)

    def _ensure_threads(self) -> None:
        with self._lock:  # two threads' first saves must start one set of threads, not two
            if not self._threads:
                self._start_threads()

    def _start_threads(self) -> None:
        ref = weakref.ref(self)
        loops = [("stage", self._stage_q, self._write_q), ("write", self._write_q, self._commit_q)]
        if self.is_leader:
            loops.append(("commit", self._commit_q, None))
        for name, inbox, outbox in loops:
            t = threading.Thread(target=serve, args=(ref, f"_{name}_one", inbox, outbox),
                                 name=f"flexckpt-{name}-r{self.rank}", daemon=True)
            t.start()
            self._threads.append(t)

    def _stage_one(self, job: SaveJob) -> None:
        if self.stage_delay:
            # let every rank leave save() before this copy takes a core and memory
            # bandwidth; a fence that arrives first cuts the pause short
            job.handle._fence_called.wait(self.stage_delay)
        t0 = time.perf_counter()
        try:
            e = job.entry
            job.buffer.ensure(e.rank_plan.nbytes, pin=e.device.type == "cuda")
            dsts = job.buffer.views(e.id, e.rank_plan, e.plan.specs, e.shapes)
            self._copies[e.device].copy(dsts, job.srcs, job.ready)
        except BaseException as exc:  # noqa: BLE001 - reported on the handle
            self._pool.release(job.buffer)
            self._report_failure(job, exc, "staging")
            return
        finally:
            job.srcs = None  # the state is the caller's again
        job.handle.timings["stage_s"] = time.perf_counter() - t0
        job.staged_ok = True
        job.handle._staged.set()
        self._write_q.put(job)

    def _write_one(self, job: SaveJob) -> None:
        t0 = time.perf_counter()
        try:
            e = job.entry
            rank_plan = e.rank_plan
            folder = f"{step_dir(job.step)}/{job.attempt}"
            with self._folders_lock:  # and another rank's retention (a process) may rmdir the empty step folder
                makedirs(self.storage, folder)
            if rank_plan.nbytes:
                job.chunks = write_data_file(
                    self.storage, f"{step_dir(job.step)}/{data_name(job.attempt, self.rank)}",
                    memoryview(job.buffer.data.numpy()), rank_plan.nbytes,
                    rank_plan.chunks, self.compression, self.fsync, self.direct_io, job.sums,
                )
        except BaseException as exc:  # noqa: BLE001
            self._report_failure(job, exc, "writing")
            return
        finally:
            self._pool.release(job.buffer)
        try:
            job.line = write_rank_files(
                self.storage, step_dir(job.step), rank=self.rank, attempt=job.attempt, fingerprint=e.fingerprint,
                codec=self.compression.codec, chunks=job.chunks, per_rank=job.per_rank, fsync=self.fsync,
            ).line
        except BaseException as exc:  # noqa: BLE001
            self._report_failure(job, exc, "writing its chunk table")
            return
        job.handle.timings["write_s"] = time.perf_counter() - t0
        job.handle.timings["bytes"] = float(rank_plan.nbytes)
        if self.is_leader:
            self._commit_q.put(job)
            return
        try:
            # no fsync: a record only tells the leader that this rank's (fsynced) files are
            # complete; after the commit the manifest holds everything it said
            self.storage.makedirs(f"{step_dir(job.step)}/{record_name(job.attempt, self.rank).rsplit('/', 1)[0]}")
            self.storage.put_atomic(f"{step_dir(job.step)}/{record_name(job.attempt, self.rank)}",
                                    self._record(job), fsync=False)
        except BaseException as exc:  # noqa: BLE001
            self._report_failure(job, exc, "writing its record")
            return
        job.handle._done.set()

    def _record(self, job: SaveJob) -> bytes:
        e = job.entry
        # the first save with a structure: at most a group, or a pipeline stage's (rank 0
        # builds the union of the stages' structures from these, one per fingerprint)
        # (sent again until a save that carried it is seen committed: rank 0 may never have
        # read it, its commit having failed)
        send = not e.published
        if e.published_in is not None and not self.is_coordinator:
            step, attempt = e.published_in
            if self.storage.exists(f"{step_dir(step)}/{committed_name(attempt)}"):
                e.published_in = None
            else:
                send = True
        structure = None
        if send and (self.world_size <= GROUP or e.partial):
            structure, e.published_in = e.structure_bytes, (job.step, job.attempt)
        e.published = True
        return record_doc(run_id=self.run_id, attempt=job.attempt, step=job.step, world_size=self.world_size,
                          entries={self.rank: job.line}, lanes=job.lanes, structure=structure,
                          keyed=keyed_entries(self.rank, job.keyed))


def serve(ref: "weakref.ref[Any]", method: str, inbox: queue.Queue, outbox: queue.Queue | None) -> None:
    """A background thread: hand each job from ``inbox`` to the checkpointer's ``method``.
    Between jobs it holds only a weak reference, so a Checkpointer dropped without close()
    is freed; None (from close() or the finalizer) stops it and is passed down the line."""
    while True:
        job = inbox.get()
        try:
            if job is None:
                if outbox is not None:
                    outbox.put(None)
                return
            owner = ref()
            if owner is None:
                abandon(job, inbox)
                return
            getattr(owner, method)(job)
        finally:
            job = owner = None  # hold nothing while waiting for the next job
            inbox.task_done()


def abandon(job: Any, inbox: queue.Queue) -> None:
    """Fail the saves a Checkpointer freed without close() left in ``inbox``: their
    ``result()`` would otherwise wait for ever."""
    error = SaveError("the Checkpointer was freed without close() before this save finished; keep a reference to "
                      "it and call close() (or use it in a with block) to finish its saves")
    while job is not None:
        handle = getattr(job, "handle", None)
        if handle is not None:
            handle._fail(error)
        try:
            job = inbox.get_nowait()
        except queue.Empty:
            return
        inbox.task_done()


def stop_threads(queues: tuple[queue.Queue, ...], at_exit: Any) -> None:
    atexit.unregister(at_exit)
    for q in queues:
        q.put(None)
