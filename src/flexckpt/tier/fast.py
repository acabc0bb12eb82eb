"""The fast tier's runtime, composed by ``Checkpointer`` (see ``LocalTier``).

Save (``save``, training thread): walk and plan as a persistent save does, queue the job,
return a ``SaveHandle``; no collective. A background thread stages the pieces into a
buffer of its own (the fence), writes the rank's files in the v2 format into the node's
folder (a local ``Storage``), marks them complete, prunes to ``keep_last`` steps, then
sends a copy to each partner (``transport.send``). A fast save that falls due while the
previous one is still in flight is skipped and counted, never waited for. A fast save of
the step and state the last persistent save took walks and stages nothing: it reads that
save's staged buffer (one more holder of it, ``BufferPool.share``) and lets go of it once
the node's data file is written; the copy is sent from that file.

Recover (``recover``, every rank, at ``load()``): one all-gather of the nodes' inventories
on the tier's group, the newest step complete across the surviving nodes (or partly held,
its missing saved ranks served by the store's same save), then one all-gather of what each
rank asks of its peers: only the byte ranges its load reads of files its node lacks. The
ordinary load then runs over a ``StepView``: the node's folder, the ranges as they arrive
(sent with send/recv), the store's files of missing ranks. Timings by phase go to
``last_recovery.timings``: inventory, plan (manifest, read plan, asks), post (sends and
receives posted), read (the load; ``wait_peer_s`` of it waiting for ranges), drain, agree
(the all-gather of every rank's outcome), finish (the other steps set aside, removed on
a thread of their own, and the values applied).
"""
from __future__ import annotations

import functools
import hashlib
import logging
import mmap
import os
import queue
import shutil
import threading
import time
import uuid
import datetime
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson
import torch
import torch.distributed as dist

from flexckpt.checksum import checksum
from flexckpt.commit import keyed_entries, read_manifest, write_keyed
from flexckpt.load import PendingLoad
from flexckpt.checksum import ALGORITHM
from flexckpt.manifest import (
    FORMAT, VERSION, SavedTensor, data_name, keyed_name, seal, step_dir, table_name, values_name,
)
from flexckpt.manifest_parse import parse_manifest
from flexckpt.errors import SaveError
from flexckpt.handle import SaveHandle
from flexckpt.plan import part_of_world
from flexckpt.save_pipeline import Attempts
from flexckpt.savers import await_peers
from flexckpt.stages import union_structure
from flexckpt.staging import StagingBuffer, copies_for
from flexckpt.storage import Storage, makedirs
from flexckpt.structure import excluder, walk
from flexckpt.tier import LocalTier
from flexckpt.tier.inventory import (
    Decision, Held, check_copy, choose, compat_fingerprint, compat_union, done_name, file_lengths,
    MAX_DONE_BYTES, remove_bundle,
    remove_paths, scan, set_aside, set_aside_before,
)
from flexckpt.tier.owner import folder_id, hold, release, remove_if_unowned
from flexckpt.tier.placement import node_name, nodes_of, partners, sources
from flexckpt.tier.fetchplan import Ask, Transfer, assign, ranges_needed, saved_rank
from flexckpt.tier.transport import Files, Header, Inbox, Incoming, announce, digest, send, send_range
from flexckpt.tier.view import Received, StepView
from flexckpt.writer import raw_chunks, table_bytes, values_bytes
from flexshard.world import ranks as n_ranks

log = logging.getLogger("flexckpt")

PREFIX = "flexckpt-tier-"


@dataclass
class Recovery:
    """What ``load()`` did with the fast tier: the decision, and where each saved rank's
    files came from (``"own node NAME"``, ``"node NAME via rank K"``)."""

    source: str
    step: int | None
    reason: str
    parts: dict[int, str] = field(default_factory=dict)
    fetched_bytes: int = 0  # received from peers (asked byte ranges, chunk tables, per-rank values)
    sent_bytes: int = 0  # sent to recovering peers
    fetched: dict[str, int] = field(default_factory=dict)  # bytes received by file (relative to the step)
    seconds: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)  # phases (seconds): see recover()
    other_structure: bool = False  # the tier held a complete step saved with another structure (kept)


@dataclass(eq=False)
class _FastJob:
    step: int
    attempt: str
    handle: Any
    entry: Any
    srcs: list | None
    plain: dict
    lanes: dict
    per_rank: dict
    copy: Any  # the staging copy of srcs into the buffer, CPU or CUDA (None when shared holds the bytes)
    keyed: dict = field(default_factory=dict)  # bytes values by key (carried in the marker, as records carry them)
    shared: Any = None  # the persistent save of the same step whose staged buffer this save reads
    release: Any = None  # lets go of that buffer (once, after the node's data file is written)
    branch: int = 0  # the run's branch in this launch when save() was called (see FastTier.abandon)

    def let_go(self) -> None:
        """Release the shared staging buffer, if this save still holds it."""
        if self.release is not None:
            self.release()
            self.release = None


RUN_FOLDER = "fast-tier.json"  # in the run's persistent folder: its identity and its launches with a fast tier


def this_launch(storage: Storage) -> tuple[str, int, bool]:
    """``(id, launch, written)``: the run folder ``storage``'s identity and this launch's
    number among those with a fast tier, from its ``fast-tier.json``, counted up there
    (``written``); without one (a new folder, or one removed and made again: the tiers of
    the earlier folder are not this one's), a new random id and launch 1, written with
    the first fast save (a refused start leaves the folder as it was)."""
    try:
        raw = storage.read_bytes(RUN_FOLDER, limit=1 << 16)
    except FileNotFoundError:
        return uuid.uuid4().hex, 1, False
    try:
        doc = orjson.loads(raw)
        run, launch = str(doc["id"]), int(doc["launches"]) + 1
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{storage.path(RUN_FOLDER)} is not a fast tier's record of its run folder ({exc}); remove "
                         f"it to start the fast tier afresh (its steps of this run folder are then not restored)") from None
    write_run_folder(storage, run, launch)
    return run, launch, True


def write_run_folder(storage: Storage, run: str, launches: int) -> None:
    storage.makedirs("")
    storage.put_atomic(RUN_FOLDER, orjson.dumps({"id": run, "launches": launches}), fsync=False)


def _lineage_of(files: list[str]) -> str | None:
    """The lineage a tier folder's first readable marker names, or None."""
    for f in files:
        if f.endswith(".done"):
            try:
                with open(f, "rb") as fh:
                    return str(orjson.loads(fh.read(MAX_DONE_BYTES))["lineage"])
            except Exception:  # noqa: BLE001 - a damaged marker names nothing
                continue
    return None


class FastTier:
    def __init__(self, config: LocalTier, host: Any, staging: Any) -> None:
        self.config = config
        self._host, self._staging = host, staging
        self.rank, self.world = host.rank, host.world_size
        self.run_id, self.session = host.run_id, host.session
        self.lineage = config.resolved_lineage(host.storage.url)
        self.node = node_name()
        self.dir = config.dir.replace("{node}", self.node)  # "{node}": one folder a node on one machine (tests)
        os.makedirs(self.dir, exist_ok=True)
        self.group = None
        self.store = None
        self.timeout = float(config.timeout)
        self._run_store = host.storage
        run = this_launch(host.storage) if self.rank == 0 else None
        gathered = [(self.node, run)]
        if self.world > 1:
            if not (dist.is_available() and dist.is_initialized()):
                raise ValueError("a fast tier with more than one rank needs torch.distributed initialized")
            if host.group is not None and dist.get_world_size(host.group) != dist.get_world_size():
                raise ValueError(
                    f"a fast tier spans the whole job (its gloo group is made by every rank); this Checkpointer's "
                    f"process_group has {dist.get_world_size(host.group)} of {dist.get_world_size()} ranks: drop local= "
                    f"or process_group="
                )
            ranks = None if host.group is None else dist.get_process_group_ranks(host.group)
            self.global_ranks = list(range(self.world)) if ranks is None else list(ranks)
            # this job's keys in its store (the tier folder's name needs the gather below)
            keys = PREFIX + hashlib.sha256(f"{self.lineage}\0{host.storage.url}".encode()).hexdigest()[:16]
            self.store = dist.PrefixStore(f"{keys}/{self.session}", dist.distributed_c10d._get_default_store())
            await_peers(self.store, self.global_ranks[self.rank], self.global_ranks, self.timeout,
                        "a fast tier (local=, LocalTier.timeout)")
            # created here, on the training thread, in the same order on every rank
            self.group = dist.new_group(ranks=ranks, backend="gloo", timeout=datetime.timedelta(seconds=self.timeout))
            gathered = [None] * self.world
            dist.all_gather_object(gathered, (self.node, run), group=self.group)
        else:
            self.global_ranks = [0]
        names = [str(g[0]) for g in gathered]
        # the run folder's identity (made with its first fast save) and this launch's number: a
        # tier outlives no removal of its run folder, and launches never tie
        self.folder_run_id, self.launch, self._run_written = gathered[0][1]
        name = PREFIX + hashlib.sha256(f"{self.lineage}\0{host.storage.url}\0{self.folder_run_id}".encode()).hexdigest()[:16]
        self.root = os.path.join(os.path.abspath(self.dir), name)
        hold(self.root)  # for this tier's life: no other job sweeps it while this process lives
        self._held = True
        self._remove_stale_tiers(name)
        self.folder_id = folder_id(self.root)
        self._sweepers: list[threading.Thread] = []
        self._sweep(set_aside_before(self.root))
        self.storage = Storage(self.root, None, None)
        self.nodes = nodes_of(names)
        self.node_names = names
        self.partners = partners(self.rank, self.nodes, config.replicas)
        self.sources = sources(self.rank, self.nodes, config.replicas)
        if config.replicas and len(self.nodes) < 2 and self.rank == 0:  # the same on every rank: said once
            log.warning("flexckpt fast tier: %s on node %r; no copy on another node is possible",
                        "the only rank is" if self.world == 1 else f"all {self.world} ranks are", self.node)
        if config.state_bytes is not None:
            try:
                self._check_space(int(config.state_bytes))
            except BaseException:
                self._let_go()
                raise
        self.skipped = 0
        self.saved = 0
        self.replicated = 0
        self.replication_failures = 0
        self.failed = 0  # fast saves that failed (their files removed)
        self.failing = 0  # of them, in a row up to now (0 once one succeeds)
        self.last_recovery: Recovery | None = None
        self._busy = threading.Event()
        self._jobs: queue.Queue = queue.Queue()
        self._buffer = StagingBuffer()
        self._attempts = Attempts(self.run_id, self.session)  # numbered as persistent saves are, counted apart
        self._space_checked = config.state_bytes is not None
        self._thread: threading.Thread | None = None
        self._copies: dict = {}
        self._dead_partners: set[int] = set()
        self._seq: dict[int, int] = {}
        self._structure_for: int | None = None
        self._structure: tuple[str, dict] = ("", {})
        self._prune_lock = threading.Lock()
        self._branch = 0  # bumped on every rank at abandon(): the saves after it outrank those before
        self._bundles: dict[int, list] = {}  # saved rank -> bundles this process wrote, oldest first
        self._inherited: list = []  # the restored step's bundles on this node (its leader removes them)
        self._closed = False
        self._inboxes = [
            Inbox(self.group, self.store, "copy", self.global_ranks[s], self.global_ranks[self.rank], self.timeout,
                  self._deliver, f"flexckpt-tier-recv-r{self.rank}-from{s}")
            for s in self.sources
        ] if self.group is not None else []
        for box in self._inboxes:
            box.start()

    # -- hygiene ------------------------------------------------------------------------------
    def _remove_stale_tiers(self, mine: str) -> None:
        """Other runs' tiers in the same folder that no live process holds (``owner``),
        untouched for ``stale_after`` seconds. The lineages (run ids) of the other tiers
        found are kept in ``other_lineages`` for the recovery's message."""
        self.other_lineages: list[str] = []
        for entry in os.scandir(self.dir):
            if not entry.name.startswith(PREFIX) or entry.name == mine or not entry.is_dir():
                continue
            files = [os.path.join(d, f) for d, _, fs in os.walk(entry.path) for f in fs]
            lineage = _lineage_of(files)
            if lineage is not None and lineage != self.lineage and lineage not in self.other_lineages:
                self.other_lineages.append(lineage)
            if remove_if_unowned(entry.path, self.config.stale_after):
                log.info("flexckpt fast tier: removed another run's tier %s", entry.path)

    def _check_space(self, state_bytes: int) -> None:
        """(1 + replicas) x keep_last x this node's share of the state must fit."""
        on_node = len(next(ranks for ranks in self.nodes if self.rank in ranks))
        copies = 1 + len(self.partners)
        need = copies * self.config.keep_last * state_bytes * on_node
        usage = shutil.disk_usage(self.root)
        held = _bytes_under(self.root)
        if need > usage.free + held:
            raise ValueError(
                f"fast tier {self.dir}: needs {need} bytes ({copies} {'copy' if copies == 1 else 'copies'} x keep_last {self.config.keep_last} x "
                f"{state_bytes} bytes a rank x {n_ranks(on_node)} on this node), {usage.free + held} free "
                f"(a container's /dev/shm is 64 MiB by default: raise it, e.g. docker --shm-size, or lower keep_last/replicas)"
            )

    # -- saving --------------------------------------------------------------------------------
    def save(self, step: int, state: dict) -> Any:
        if self._closed:
            raise RuntimeError("this fast tier is closed")
        step_dir(step)
        if self._busy.is_set():
            self.skipped += 1
            log.info("flexckpt fast tier: step %d skipped (the previous fast save is still in flight; %d skipped)",
                     step, self.skipped)
            return None
        shared = self._staging.share_staged(step, state)  # the persistent save of this step: its capture and bytes
        if shared is not None:
            entry, srcs, plain, lanes, per_rank, keyed = (shared.entry, None, shared.plain, shared.lanes,
                                                          shared.per_rank, shared.keyed)
        else:
            w = walk(state, self.rank, self.world)
            entry = self._staging.plan_for(w)
            srcs, plain, lanes, per_rank = self._staging.capture(w, entry)  # now: the pipeline moves on
            keyed = dict(w.keyed)
        if not self._space_checked:
            try:
                self._check_space(entry.rank_plan.nbytes)
            except BaseException:
                if shared is not None:
                    self._staging.release(shared.buffer)
                raise
            self._space_checked = True
        if not self._run_written and self.rank == 0:  # the run folder's record: made with rank 0's first fast save
            try:
                write_run_folder(self._run_store, self.folder_run_id, self.launch)
            except BaseException:
                if shared is not None:
                    self._staging.release(shared.buffer)
                raise
            self._run_written = True
        lanes = {k: orjson.Fragment(v) for k, v in lanes.items()}
        attempt = self._attempts.next(step)
        handle = SaveHandle(step, None, attempt, fence_of=None if shared is None else shared.handle)
        copy = self._copier(entry) if shared is None else None
        self._busy.set()
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name=f"flexckpt-tier-r{self.rank}", daemon=True)
            self._thread.start()
        release = None if shared is None else functools.partial(self._staging.release, shared.buffer)
        self._jobs.put(_FastJob(step, attempt, handle, entry, srcs, plain, lanes, per_rank, copy, keyed, shared, release,
                                self._branch))
        return handle

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                self._save_one(job)
            except BaseException as exc:  # noqa: BLE001 - reported on the handle
                self._discard(job)
                self.failed += 1
                self.failing += 1
                job.handle.timings["failed_in_a_row"] = float(self.failing)
                log.error("flexckpt fast tier rank %d: save of step %d failed (its files removed): %s", self.rank,
                          job.step, exc, exc_info=exc)
                if self.failing > 1:
                    with self._prune_lock:
                        held = sorted({b[0] for bs in self._bundles.values() for b in bs} | {b[0] for b in self._inherited})
                    log.warning("flexckpt fast tier rank %d: %d fast saves in a row failed; the tier is not protecting "
                                "the run (it holds step(s) %s of this rank's saves)", self.rank, self.failing, held)
                self._busy.clear()
                job.handle._fail(exc)
            finally:
                job.srcs = None
                job.let_go()  # (already, unless it failed before its data file was written)
                # not _busy.clear() here: _save_one cleared it before its handle said done, and
                # the next fast save may have set it since (its job then waits in the queue)

    def _save_one(self, job: _FastJob) -> None:
        e, h = job.entry, job.handle
        t0 = time.perf_counter()
        if job.shared is not None:  # the persistent save stages the bytes; this save reads its buffer
            job.shared.handle._staged.wait()
            if not job.shared.staged_ok:
                raise SaveError(f"the persistent save of step {job.step}, whose staged bytes this fast save takes, "
                                f"failed while staging: {job.shared.handle.exception()}")
            stream = memoryview(job.shared.buffer.data.numpy())
        else:
            try:
                self._buffer.ensure(e.rank_plan.nbytes, pin=_on_gpu(e))
                dsts = self._buffer.views(e.id, e.rank_plan, e.plan.specs, e.shapes)
                job.copy(dsts, job.srcs)
            finally:
                job.srcs = None
                h._staged.set()
            stream = memoryview(self._buffer.data.numpy())
        h.timings["stage_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        folder = step_dir(job.step)
        self._prune(self.rank, self.config.keep_last - 1)  # room for this step: keep_last steps at most
        makedirs(self.storage, f"{folder}/{job.attempt}")
        chunks = []
        data = f"{folder}/{data_name(job.attempt, self.rank)}"
        files: dict[str, bytes | memoryview | np.ndarray] = {}
        if e.rank_plan.nbytes:
            write_node_file(self.storage, data, stream, e.rank_plan.nbytes)
        job.let_go()  # the node's file holds the bytes now: the buffer may be staged into again
        if e.rank_plan.nbytes:  # hashed from the node's file, and the copy sent from it (mapped): no buffer held
            files[data_name(job.attempt, self.rank)] = mapped = _mapped(self.storage.path(data), 0, e.rank_plan.nbytes)
            # a shared save's chunks are hashed once, by whichever of the two writers comes first
            chunks = raw_chunks(memoryview(mapped), e.rank_plan.chunks, None if job.shared is None else job.shared.sums)
        table = table_bytes(rank=self.rank, attempt=job.attempt, codec="none", chunks=chunks)
        values = values_bytes(job.per_rank)
        files[table_name(job.attempt, self.rank)] = table
        self.storage.put_atomic(f"{folder}/{table_name(job.attempt, self.rank)}", table, fsync=False)
        if values:
            files[values_name(job.attempt, self.rank)] = values
            self.storage.put_atomic(f"{folder}/{values_name(job.attempt, self.rank)}", values, fsync=False)
        line = [e.fingerprint, checksum(table), len(table), sum(c.length for c in chunks),
                checksum(values) if values else "", len(values)]
        doc = {
            "lineage": self.lineage, "fingerprint": self._saved_structure(e)[0], "saved_fingerprint": e.fingerprint,
            "step": job.step, "attempt": job.attempt, "rank": self.rank, "world_size": self.world,
            "run_id": self.run_id, "launch": self.launch, "branch": job.branch, "line": line, "lanes": job.lanes,
            "plain": job.plain,
            "per_rank_keys": e.per_rank_keys, **self._saved_structure(e)[1],
            **({"keyed": keyed_entries(self.rank, job.keyed)} if job.keyed else {}),
            "files": {rel: memoryview(b).nbytes for rel, b in files.items()}, "chunks": len(chunks),
        }
        meta = orjson.dumps(doc)
        self.storage.put_atomic(f"{folder}/{done_name(job.attempt, self.rank, self.world)}", meta, fsync=False)
        self._wrote(doc)
        h.timings["write_s"] = time.perf_counter() - t1
        self.saved += 1
        t2 = time.perf_counter()
        if self.partners:
            # sent from where they are (the node's data file, mapped; the table and values): no packed copy
            header = Header(job.step, int(job.attempt.rsplit(".", 1)[1]), self.global_ranks[self.rank],
                            len(meta) + sum(doc["files"].values()), digest(meta), 0, len(meta))
            for p in self.partners:
                if p in self._dead_partners:
                    continue
                seq = self._seq.get(p, 0)
                try:
                    send(self.group, self.store, "copy", self.global_ranks[p], header._replace(seq=seq), meta,
                         list(files.values()), self.timeout)
                    self._seq[p] = seq + 1
                    self.replicated += 1
                except Exception as exc:  # noqa: BLE001 - a partner gone; the local copy stands
                    self._dead_partners.add(p)
                    self.replication_failures += 1
                    log.error("flexckpt fast tier rank %d: copy of step %d to rank %d failed: %s", self.rank, job.step, p, exc)
        h.timings["replicate_s"] = time.perf_counter() - t2
        h.timings["bytes"] = float(e.rank_plan.nbytes)
        if self.failing:
            log.warning("flexckpt fast tier rank %d: step %d saved after %d failed fast save(s): the tier protects the "
                        "run again", self.rank, job.step, self.failing)
            self.failing = 0
        h.timings["failed_in_a_row"] = 0.0
        self._busy.clear()
        h._done.set()

    def _discard(self, job: _FastJob) -> None:
        """What a failed fast save wrote of this rank's files (a full tmpfs must not keep it
        full): its marker first, then its files, then its folders if empty."""
        names = [f(job.attempt, self.rank) for f in (data_name, table_name, values_name)]
        try:
            remove_bundle(self.storage, job.step, done_name(job.attempt, self.rank, self.world), names)
        except Exception as exc:  # noqa: BLE001 - the failure is reported already; a close() removes the rest
            log.warning("flexckpt fast tier rank %d: removing the failed save of step %d: %s", self.rank, job.step, exc)

    def _copier(self, e: Any) -> Any:
        """The staging copy for ``e``'s pieces, marked ready here on the training thread:
        the checkpointer's own staging copies (``flexckpt.staging.copies_for``)."""
        if e.device not in self._copies:
            self._copies[e.device] = copies_for(e.device)
        copies = self._copies[e.device]
        ready = copies.ready()
        return lambda dsts, srcs: copies.copy(dsts, srcs, ready)

    def _saved_structure(self, e: Any) -> tuple[str, dict]:
        """The world-independent fingerprint of a plan's structure, and what this rank's
        marker carries of it: saved rank 0's, its tensors with their saved layouts, the plan
        rules and its structure; a pipeline stage's lowest rank (the lowest rank of the
        meshes its stage's tensors live on), its structure, from which a recovery builds the
        union of the stages' as the persistent commit does (:mod:`flexckpt.stages`)."""
        if self._structure_for != e.id:
            lowest = [min(t.layout.rank_table()) for t in e.plan.specs if part_of_world(t.layout, self.world)]
            carried: dict = {"structure": e.structure} if self.rank == 0 or (lowest and self.rank == min(lowest)) else {}
            if self.rank == 0:
                tensors = {t.name: SavedTensor(t.name, t.dtype, t.shape, t.layout).to_json() for t in e.plan.specs}
                carried.update(tensors=tensors, rules=e.plan.rules.to_json())
            self._structure = (compat_fingerprint(e.structure), carried)
            self._structure_for = e.id
        return self._structure

    def _deliver(self, header: Header, meta: bytes, incoming: Files) -> None:
        """A partner's copy: its marker (checked whole by ``transport.recv``) names its files,
        received next; each is checked once, as the load would: the table and the values
        against the marker's line, each chunk of the data file against the table. Then the
        files are written, then the marker."""
        doc = orjson.loads(meta)
        lengths = file_lengths(doc)
        parts = incoming.receive(list(lengths.values()))
        if (doc["step"], doc["rank"]) != (header.step, self.global_ranks.index(header.source)):
            raise ValueError(f"copy header says step {header.step} of rank {header.source}, its marker "
                             f"step {doc['step']} of rank {doc['rank']}")
        files = list(zip(lengths, parts))
        check_copy(doc, files)
        self._write_bundle(doc, files)

    def _write_bundle(self, doc: dict, files: list) -> None:
        folder = step_dir(doc["step"])
        self._prune(doc["rank"], self.config.keep_last - 1)
        makedirs(self.storage, f"{folder}/{doc['attempt']}")
        marker = done_name(doc["attempt"], doc["rank"], doc["world_size"])
        try:
            for rel, data in files:
                self.storage.put_atomic(f"{folder}/{rel}", data, fsync=False)
            self.storage.put_atomic(f"{folder}/{marker}", orjson.dumps(doc), fsync=False)
        except BaseException:  # a full tmpfs: the copy's files go (the inbox reports the failure)
            remove_bundle(self.storage, doc["step"], marker, [rel for rel, _ in files])
            raise
        self._wrote(doc)

    def _wrote(self, doc: dict) -> None:
        with self._prune_lock:
            self._bundles.setdefault(doc["rank"], []).append(
                (doc["step"], done_name(doc["attempt"], doc["rank"], doc["world_size"]), list(doc["files"])))

    def _prune(self, saved_rank: int, keep: int) -> None:
        """Each process removes only the bundles it wrote (ranks of one node share its
        folder): those of ``saved_rank`` but the newest ``keep``."""
        with self._prune_lock:
            mine = self._bundles.get(saved_rank, [])
            cut = max(0, len(mine) - keep)  # (fewer than keep: none goes; a negative cut took all but keep's excess)
            old, self._bundles[saved_rank] = (mine[:cut], mine[cut:]) if keep else (mine, [])
            if saved_rank == self.rank and len(self._bundles[saved_rank]) >= keep and self._inherited:
                old, self._inherited = old + self._inherited, []  # the restored step, once keep newer ones exist
        for step, doc_name, files in old:
            remove_bundle(self.storage, step, doc_name, files)

    def wait(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._busy.is_set():
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"fast save still in flight after {timeout} s")
            time.sleep(0.005)

    def close(self, remove: bool = True) -> None:
        """Stop the threads; at a clean exit the node's tier folder goes too."""
        if self._closed:
            return
        self._closed = True
        try:
            self.wait(self.timeout)
        except TimeoutError:
            log.warning("flexckpt fast tier: closing with a fast save in flight")
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(self.timeout)
        for box in self._inboxes:
            box.stop.set()
        for box in self._inboxes:
            box.join(self.timeout)
        for sweeper in self._sweepers:
            sweeper.join(self.timeout)
        if remove:
            shutil.rmtree(self.root, ignore_errors=True)
        self._let_go()

    def _let_go(self) -> None:
        """This tier no longer holds its folder (once)."""
        if self._held:
            self._held = False
            release(self.root)

    # -- recovery ------------------------------------------------------------------------------
    def abandon(self, aside: bool) -> None:
        """A load that the tier did not serve (``load(step=N)``, ``load(strict=False)``):
        the run may go on from the store's step, so every fast save from now on belongs to
        a new branch, which outranks every step held now (``inventory.choose``; a partner's
        copy sent before this, landing after, too). With ``aside`` (``load(step=N)``: a
        rollback), every held step is set aside as well, by the lowest rank of each tier
        folder, as after a failed tier load: one all-gather on the tier's group, after each
        rank's own fast saves are done. Every rank calls it, as ``load()`` is."""
        self.wait()
        self._branch += 1
        if not aside:
            return
        folders = self._all_gather((self.node, self.folder_id))
        if self.rank == folders.index((self.node, self.folder_id)):
            self._sweep(set_aside(self.root, -1))
        with self._prune_lock:
            self._bundles.clear()
            self._inherited = []

    def newest_held(self) -> int | None:
        """The newest step some node's folder holds a complete saved-rank bundle of (this
        lineage's), or None: one all-gather on the tier's group (every rank calls it, and
        gets the same answer). Whether that step can be restored (every saved rank held,
        the state's structure) is ``recover``'s to decide; this only says one may be."""
        try:
            mine = max((h.step for h in scan(self.storage) if h.doc.get("lineage") == self.lineage), default=None)
        except Exception as exc:  # noqa: BLE001 - every rank must reach the gather; recover() reports it
            log.warning("flexckpt fast tier rank %d: listing %s failed: %s", self.rank, self.root, exc)
            mine = None
        return max((s for s in self._all_gather(mine) if s is not None), default=None)

    def recover(self, state: dict, strict: bool, exclude: tuple[str, ...] = ()) -> tuple[int, Any] | None:
        """Restore the newest step complete across the surviving nodes: the step and the
        load's ``LoadStats``; None when the persistent store must serve the load (the reason is in ``last_recovery``).
        ``exclude`` as ``load()`` takes it: those leaves are left out of the structure
        compared and of the load."""
        t0 = time.perf_counter()
        try:
            full = walk(state, self.rank, self.world)
            gone = excluder(exclude)  # load() checked the patterns
            w = full.without(gone)
            fp = compat_fingerprint(w.structure_json())
            held = scan(self.storage)
            persistent = self._host.steps() if self.rank == 0 else []
            mine = (self.node, [(h.step, h.attempt, h.rank, h.world, h.doc) for h in held], persistent, fp, "",
                    self.folder_id)
        except Exception as exc:  # noqa: BLE001 - every rank must reach the gather below
            mine = (self.node, [], [], "", f"rank {self.rank}: {type(exc).__name__}: {exc}", self.folder_id)
        gathered = self._all_gather(mine)
        inventories = [[Held(*x) for x in g[1]] for g in gathered]
        errors = [g[4] for g in gathered if g[4]]
        clash = node_clash([(g[0], g[5]) for g in gathered])
        if errors:
            decision = Decision("persistent", None, reason=f"the fast tier could not be read ({errors[0]})")
        elif clash:
            decision = Decision("persistent", None, reason=clash)
        else:
            target = self._target_compat([g[3] for g in gathered], w)
            decision = choose(inventories, self.lineage, target, gathered[0][2], exclude)
        # the lowest rank of each folder (of each machine, also where two report one node name)
        leader = self.rank == min(r for r, g in enumerate(gathered) if (g[0], g[5]) == (self.node, self.folder_id))
        if decision.source != "tier":
            # nothing here is loadable: older than the persistent step, or incomplete; but a step saved
            # with another structure stays (a load with a changed config must not cost the run its newest step)
            if leader and not errors and not decision.other_structure:
                self._sweep(set_aside(self.root, -1))
            reason = decision.reason
            if self.other_lineages and not inventories[self.rank]:
                reason += (f"; this node's tier folder {self.dir} held the tier of run id {self.other_lineages[0]!r}, not "
                           f"this launch's {self.lineage!r}: FLEXCKPT_RUN_ID must be the same on every launch for a "
                           f"relaunch to find its tier")
            log.warning("flexckpt fast tier: %s", reason)
            self.last_recovery = Recovery(decision.source, decision.step, reason, seconds=time.perf_counter() - t0,
                                          other_structure=decision.other_structure)
            return None
        report = Recovery("tier", decision.step, decision.reason)
        t1 = time.perf_counter()
        report.timings["inventory_s"] = t1 - t0
        error: BaseException | None = None
        pending = None
        view = StepView(self.storage, {})
        asks: dict[int, list[Ask]] = {}
        self._into: dict[tuple[str, int], np.ndarray] = {}  # asked ranges received straight into a target
        try:
            manifest = self._store_manifest(self._host, decision) if decision.missing else self._manifest(decision, w)
            manifest.files.bind(view, step_dir(decision.step))
            pending = PendingLoad(view, manifest, full, self.rank, self.world, strict, gone)
            asks, report.parts = self._plan_sources(decision, manifest, pending, gathered, self._host, view)
        except Exception as exc:  # noqa: BLE001 - every rank must reach the collectives below
            error, asks = exc, {}
        transfers = assign(self._all_gather(asks), decision.holders)
        for t in transfers:
            if t.receiver == self.rank:
                report.parts[t.saved] = f"node {gathered[t.server][0]} via rank {t.server}"
        t2 = time.perf_counter()
        report.timings["plan_s"] = t2 - t1
        sends, incoming, fail = self._exchange(decision.step, transfers, view)
        error = error or fail
        t3 = time.perf_counter()
        report.timings["post_s"] = t3 - t2
        if error is None:
            try:
                assert pending is not None
                pending.read(self._host.read_threads)  # this node's files are read while the peers' ranges arrive
            except Exception as exc:  # noqa: BLE001
                error = exc
        t4 = time.perf_counter()
        report.timings["read_s"] = t4 - t3
        report.timings["wait_peer_s"] = sum(box.waited for box in incoming)
        try:  # even after a failure: every posted receive and send completes, so the pairs stay in step
            for box in incoming:
                box.wait_all()
            for work in sends:
                (work[0] if isinstance(work, tuple) else work).wait(datetime.timedelta(seconds=self.timeout))
        except Exception as exc:  # noqa: BLE001
            error = error or exc
        sends, self._into = [], {}
        report.timings["drain_s"] = time.perf_counter() - t4
        report.fetched_bytes = sum(t.nbytes for t in transfers if t.receiver == self.rank)
        report.sent_bytes = sum(t.nbytes for t in transfers if t.server == self.rank)
        for t in transfers:
            for a in t.asks if t.receiver == self.rank else ():
                report.fetched[a.rel] = report.fetched.get(a.rel, 0) + a.length
        t5 = time.perf_counter()
        failed = self._all_gather(error is not None)
        report.timings["agree_s"] = time.perf_counter() - t5
        if leader:  # every rank has read: the step's bytes values file (written for the load) goes
            self.storage.remove(f"{step_dir(decision.step)}/{keyed_name(decision.attempt)}")
        if any(failed):
            why = f"the fast-tier load of step {decision.step} failed on rank(s) {[r for r, f in enumerate(failed) if f]}"
            if error is not None:
                why += f" (here: {type(error).__name__}: {error})"
            log.error("flexckpt fast tier: %s; loading from the persistent store", why)
            if leader:  # the run goes on from an older step: this one may never outrank its new steps
                self._sweep(set_aside(self.root, -1))
            self.last_recovery = Recovery("persistent", None, why, seconds=time.perf_counter() - t0)
            return None
        assert pending is not None
        t6 = time.perf_counter()
        if leader:  # every rank has read: keep only the restored step, owned by the node's leader from now on
            self._sweep(set_aside(self.root, decision.step))
            with self._prune_lock:
                self._inherited = [(h.step, done_name(h.attempt, h.rank, h.world), list(h.doc["files"]))
                                   for h in scan(self.storage)]
        pending.apply()
        report.timings["finish_s"] = time.perf_counter() - t6
        report.seconds = time.perf_counter() - t0
        self.last_recovery = report
        log.info("flexckpt fast tier: restored step %d (%s); parts: %s", decision.step, decision.reason, report.parts)
        return decision.step, pending.stats

    def _sweep(self, paths: list[str]) -> None:
        """Remove set-aside step folders on a thread of their own (``close()`` waits for it)."""
        if paths:
            sweeper = threading.Thread(target=remove_paths, args=(paths,), name=f"flexckpt-tier-sweep-r{self.rank}",
                                       daemon=True)
            sweeper.start()
            self._sweepers.append(sweeper)

    def _all_gather(self, obj: Any) -> list:
        if self.group is None:
            return [obj]
        out: list = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def _target_compat(self, fps: list[str], w: Any) -> str:
        """The union of the target ranks' structures (:func:`compat_union`): their common
        fingerprint, or, when they differ (pipeline stages), from one structure per
        fingerprint, sent by its lowest rank (one more all-gather, only then)."""
        if len(set(fps)) == 1:
            return fps[0]
        mine = w.structure_json() if fps.index(fps[self.rank]) == self.rank else None
        return compat_union([st for st in self._all_gather(mine) if st is not None])

    def _manifest(self, d: Decision, w: Any) -> Any:
        """The saved step's manifest, rebuilt from the ranks' markers: tensors with their
        saved layouts from saved rank 0's (or, when the saved ranks' structures differ, the
        union of the stages' structures the markers carry, built and checked as the
        persistent commit builds it), the plan rules from rank 0's, a line and lanes from
        each, and the bytes values, written to the step's ``keyed.values`` on this node."""
        docs = d.docs
        first = docs[0]
        lanes: dict[str, dict] = {}
        for r in range(d.world):
            for path, mapping in docs[r]["lanes"].items():
                lanes.setdefault(path, {}).update(mapping)
        tensors, fp = first["tensors"], first["saved_fingerprint"]
        entries = {r: docs[r]["line"] for r in range(d.world)}
        if len({line[0] for line in entries.values()}) > 1:
            carried = {doc["line"][0]: doc["structure"] for doc in docs.values() if isinstance(doc.get("structure"), dict)}
            union = union_structure(entries, d.step, first["line"][0], first["structure"], carried, d.world)
            assert union is not None  # the lines differ
            specs, _structure, fp = union
            tensors = {t.name: SavedTensor(t.name, t.dtype, t.shape, t.layout).to_json() for t in specs}
        doc = {
            "format": FORMAT, "version": VERSION, "checksum": ALGORITHM, "step": d.step, "run_id": first["run_id"],
            "attempt": d.attempt, "world_size": d.world, "time": time.time(), "fingerprint": fp,
            "rules": first["rules"], "codec": "none", "tensors": tensors,
            "ranks": [docs[r]["line"][1:] for r in range(d.world)], "plain": first["plain"], "lanes": lanes,
            "per_rank": first["per_rank_keys"],
        }
        keyed = _merged_keyed(d)
        if keyed:
            makedirs(self.storage, f"{step_dir(d.step)}/{d.attempt}")
            doc["keyed"] = {k: list(v) for k, v in write_keyed(self.storage, d.step, d.attempt, keyed, False).items()}
        return parse_manifest(seal(orjson.dumps(doc)), where=f"fast tier step {d.step}")

    def _store_manifest(self, ckpt: Any, d: Decision) -> Any:
        """The persistent store's manifest of step ``d.step``, when it is the very save the
        tier holds part of: the same attempt, world size and plan, uncompressed, and each
        saved rank the tier holds with the same table, data and values (lengths and xxh3):
        its files then stand in for the ranks no node holds."""
        m = read_manifest(ckpt.storage, d.step)
        first = next(iter(d.docs.values()))
        why = ""
        if m.version < 2 or m.attempt != d.attempt:
            why = f"it is save attempt {m.attempt}, the tier's is {d.attempt}"
        elif m.world_size != d.world or m.fingerprint != first["saved_fingerprint"]:
            why = f"it was saved by {n_ranks(m.world_size)} with another plan"
        elif m.codec != "none":
            why = f"it is compressed ({m.codec}); the tier's files are not"
        else:
            differ = [r for r, doc in sorted(d.docs.items()) if tuple(doc["line"][1:]) != tuple(m.ranks[r])]
            if differ:
                why = f"the files of saved rank(s) {differ[:10]} differ"
        if why:
            raise ValueError(f"the persistent store's step {d.step} is not the save the fast tier holds part of ({why})")
        return m

    def _plan_sources(self, d: Decision, manifest: Any, pending: PendingLoad, gathered: list, ckpt: Any,
                      view: StepView) -> tuple[dict[int, list[Ask]], dict[int, str]]:
        """Where this rank reads each saved rank's files from: its node's folder, the store
        (the ranks no node holds), or a peer, which sends only the byte ranges of the data
        file the load reads, with the chunk table (and this rank's per-rank values). Routes
        the view accordingly; returns the asks by saved rank, and where each part comes from."""
        node_of = [g[0] for g in gathered]
        here = {s for s, hs in d.holders.items() if any(node_of[h] == self.node for h in hs)}
        folder = step_dir(d.step)
        m, attempt = manifest, manifest.attempt
        targets = [(m.tensors[pending.walk.specs[i].name], rng) for i, rng in pending.targets]
        ranges = ranges_needed(m, targets, set(m.files))
        into = [_bytes_of(pending.walk.tensors[i]) for i, _rng in pending.targets]
        reading = {saved_rank(f): f for f in ranges}
        if pending.per_rank:  # at the saved world size: this rank's own per-rank values
            reading.setdefault(self.rank, "")
        asks: dict[int, list[Ask]] = {}
        parts: dict[int, str] = {}
        if d.missing and m.keyed:  # the store's manifest names its own bytes values file
            view.routes[f"{folder}/{keyed_name(attempt)}"] = ckpt.storage
        for s, data in sorted(reading.items()):
            e = m.ranks[s]
            files = [(table_name(attempt, s), e.table_nbytes)] if data else []
            if s == self.rank and pending.per_rank and e.values_nbytes:
                files.append((values_name(attempt, s), e.values_nbytes))
            if s in here:
                parts[s] = f"own node {self.node}"
            elif s in d.missing:
                parts[s] = f"persistent store step {d.step}"
                for rel, _n in files + ([(data, 0)] if data else []):
                    view.routes[f"{folder}/{rel}"] = ckpt.storage
            else:  # parts[s] is named once fetchplan.assign has picked the peer
                asks[s] = [Ask(rel, 0, n) for rel, n in files if n]
                if data:
                    asks[s] += [Ask(data, r.offset, r.length) for r in ranges[data]]
                    files.append((data, e.stored_nbytes))
                    for r in ranges[data]:
                        if r.target >= 0 and into[r.target] is not None:
                            self._into[(f"{folder}/{data}", r.offset)] = into[r.target][r.target_pos : r.target_pos + r.length]
                for rel, n in files:
                    view.routes[f"{folder}/{rel}"] = Received(f"{folder}/{rel}", n, "a peer")
        return asks, parts

    def _readable(self, t: Transfer, folder: str) -> bool:
        """Whether this node's files hold every range ``t`` asks for (else the receiver is told)."""
        try:
            for a in t.asks:
                size = os.path.getsize(self.storage.path(f"{folder}/{a.rel}"))
                if size < a.offset + a.length:
                    raise ValueError(f"{folder}/{a.rel} is {size} bytes, asked for [{a.offset}, {a.offset + a.length})")
            return True
        except Exception as exc:  # noqa: BLE001
            log.error("flexckpt fast tier rank %d: cannot read saved rank %d's files for rank %d: %s",
                      self.rank, t.saved, t.receiver, exc)
            return False

    def _exchange(self, step: int, transfers: list[Transfer], view: StepView) -> tuple[list, list[Incoming], Any]:
        """Post the sends this rank serves (straight from its node's files, mapped), then
        set up the receives it awaits, each range landing in the view's ``Received`` file.
        Runs on every rank, whatever failed before, so that every pair stays in step;
        returns the sends, the receives and the first error."""
        folder = step_dir(step)
        error: BaseException | None = None
        sends: list = []
        mine = [t for t in transfers if t.server == self.rank]
        ok = {t: self._readable(t, folder) for t in mine}
        first: dict[int, Transfer] = {}
        for t in mine:
            first.setdefault(t.receiver, t)
        for t in first.values():  # each receiver's first header at once: it sets up while ranges are mapped
            sends.append(announce(self.group, self.global_ranks[t.receiver], step, t.saved,
                                  [a.length for a in t.asks] if ok[t] else None))
        for t in mine:  # per receiver, a transfer's header and ranges in order: messages pair by order
            if first[t.receiver] is not t:
                sends.append(announce(self.group, self.global_ranks[t.receiver], step, t.saved,
                                      [a.length for a in t.asks] if ok[t] else None))
            try:
                for a in t.asks if ok[t] else ():
                    payload = _mapped(self.storage.path(f"{folder}/{a.rel}"), a.offset, a.length)
                    sends.append((send_range(self.group, self.global_ranks[t.receiver], payload), payload))
            except Exception as exc:  # noqa: BLE001 - checked above; the receiver times out on what is missing
                error = error or exc
        incoming: list[Incoming] = []
        for t in transfers:
            if t.receiver != self.rank:
                continue
            try:
                box = Incoming(self.group, self.global_ranks[t.server], step, t.saved, [a.length for a in t.asks],
                               self.timeout, [self._into.get((f"{folder}/{a.rel}", a.offset)) for a in t.asks])
            except Exception as exc:  # noqa: BLE001
                error = error or exc
                continue
            incoming.append(box)
            for i, a in enumerate(t.asks):
                file = view.routes[f"{folder}/{a.rel}"]
                file.where = f"rank {t.server} on node {self.node_names[t.server]}"
                file.add(a.offset, box.buffers[i], functools.partial(box.ready, i))
        return sends, incoming, error


def node_clash(folders: list[tuple[str, str]]) -> str:
    """``""``, or what is wrong when ranks reporting one node name scan different tier
    folders (``folders[rank] = (node name, folder id)``): two machines under one name, whose
    steps the recovery cannot place (it takes a node's ranks to share its folder)."""
    by_name: dict[str, dict[str, list[int]]] = {}
    for rank, (name, fid) in enumerate(folders):
        by_name.setdefault(name, {}).setdefault(fid, []).append(rank)
    for name, groups in by_name.items():
        if len(groups) > 1:
            ranks = " and ".join(str(rs) for rs in sorted(groups.values()))
            return (f"ranks {ranks} report one node name {name!r} but scan different tier folders: two machines "
                    f"under one name (FLEXCKPT_NODE, or the host name); give each machine a name of its own. The "
                    f"tier's steps are set aside on every machine and the load reads the persistent store")
    return ""


def write_node_file(storage: Storage, rel: str, stream: memoryview, nbytes: int) -> None:
    """A node's data file: the first ``nbytes`` of the staged stream as they are (this tier
    never compresses and never fsyncs); its chunks are hashed afterwards, from the file."""
    storage.write_stream(rel, [stream[:nbytes]], fsync=False)


def _bytes_of(t: Any) -> np.ndarray | None:
    """A target tensor's bytes, where a load reads straight into it (CPU, contiguous)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        return None
    return t.detach().reshape(-1).view(torch.uint8).numpy()


def _mapped(path: str, offset: int, length: int) -> np.ndarray:
    """Bytes ``[offset, offset + length)`` of a tier file, mapped (read-only, pages mapped
    at once), not copied: gloo sends from the page cache."""
    if not length:
        return np.empty(0, dtype=np.uint8)
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), offset + length - start, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                      prot=mmap.PROT_READ, offset=start)
    return np.frombuffer(m, dtype=np.uint8, count=length, offset=offset - start)


def _merged_keyed(d: Decision) -> dict[str, list]:
    """The step's bytes values by key, ``[lowest saved rank holding it, base64]``, from the
    markers; ValueError naming the key when two saved ranks hold it with different bytes
    (a persistent save of the same state would have failed)."""
    merged: dict[str, list] = {}
    for r in range(d.world):
        for key, v in d.docs[r].get("keyed", {}).items():
            have = merged.get(key)
            if have is not None and have[1] != v[1]:
                raise ValueError(f"fast tier step {d.step}: bytes value {key!r} differs between saved ranks {have[0]} "
                                 f"and {v[0]}; a key saved by several ranks must hold the same bytes on each")
            if have is None or v[0] < have[0]:
                merged[key] = v
    return merged


def _on_gpu(e: Any) -> bool:
    return e.device.type == "cuda"


def _bytes_under(root: str) -> int:
    """The bytes of the files under ``root``; a file removed meanwhile (a set-aside step being
    emptied on another thread, or by another rank of the node) counts as nothing."""
    total = 0
    for d, _, fs in os.walk(root):
        for f in fs:
            try:
                total += os.path.getsize(os.path.join(d, f))
            except FileNotFoundError:
                continue
    return total
