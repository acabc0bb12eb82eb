"""The fast tier's runtime, composed by ``Checkpointer`` (see ``LocalTier``) with a host
and the persistent save pipeline's staging (:mod:`flexckpt.tier.seam`).

Save (``save``, training thread): walk and plan as a persistent save does, queue the job,
return a ``SaveHandle``; no collective. A background thread stages the pieces into a
buffer of its own (the fence), writes the rank's files in the v2 format into the node's
folder (a local ``Storage``; :mod:`flexckpt.tier.save`), marks them complete, prunes to
``keep_last`` steps (:mod:`flexckpt.tier.keep`), then sends a copy to each partner
(``transport.send``). A fast save that falls due while the previous one is still in
flight is skipped and counted, never waited for. A fast save of the step and state the
last persistent save took walks and stages nothing: it reads that save's staged buffer
(``StagedSaves.share_staged``) and lets go of it once the node's data file is written;
the copy is sent from that file.

Recover (``recover``, every rank, at ``load()``): :mod:`flexckpt.tier.recover`; its
report goes to ``last_recovery``.
"""
from __future__ import annotations

import datetime
import functools
import hashlib
import logging
import os
import queue
import shutil
import threading
import time
from typing import Any

import orjson
import torch.distributed as dist

from flexckpt.format.names import data_name, step_dir, table_name, values_name
from flexckpt.load.pending import LoadStats
from flexckpt.save.commit import keyed_entries
from flexckpt.save.handle import SaveHandle
from flexckpt.save.pipeline import Attempts
from flexckpt.save.savers import await_peers
from flexckpt.save.staging import StagingBuffer, copies_for
from flexckpt.state.structure import walk
from flexckpt.storage import Storage, makedirs
from flexckpt.tier import LocalTier
from flexckpt.tier.inventory import (
    MAX_DONE_BYTES, check_copy, done_name, file_lengths, remove_bundle, remove_paths, scan, set_aside,
    set_aside_before,
)
from flexckpt.tier.keep import Holdings
from flexckpt.tier.owner import folder_id, hold, release, remove_if_unowned, this_launch, write_run_folder
from flexckpt.tier.placement import node_name, nodes_of, partners, sources
from flexckpt.tier.recover import Recovery, StepRecovery
from flexckpt.tier.save import CarriedStructure, FastJob, staged_stream, write_own
from flexckpt.tier.seam import StagedSaves, TierHost
from flexckpt.tier.transport import Files, Header, Inbox, digest, send
from flexshard.world import ranks as n_ranks

log = logging.getLogger("flexckpt")

PREFIX = "flexckpt-tier-"


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
    """One rank's fast tier. Construction is collective on every rank (the tier's gloo
    group, the nodes' names, the run folder's identity); ``save`` never is; ``recover``,
    ``abandon(aside=True)`` and ``newest_held`` are, as ``load()`` is."""

    def __init__(self, config: LocalTier, host: TierHost, staging: StagedSaves) -> None:
        self.config = config
        self.host, self.staging = host, staging
        self.rank, self.world = host.rank, host.world_size
        self.run_id, self.session = host.run_id, host.session
        self.lineage = config.resolved_lineage(host.storage.url)
        self.node = node_name()
        self.dir = config.dir.replace("{node}", self.node)  # "{node}": one folder a node on one machine (tests)
        os.makedirs(self.dir, exist_ok=True)
        self.group = None
        self.store = None
        self.timeout = float(config.timeout)
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
        self.sweep(set_aside_before(self.root))
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
        self._structure = CarriedStructure(self.rank, self.world)
        self._branch = 0  # bumped on every rank at abandon(): the saves after it outrank those before
        self.holdings = Holdings(self.storage, self.rank)  # what this process wrote here, pruned to keep_last
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
    def save(self, step: int, state: dict) -> SaveHandle | None:
        """A fast save of ``state`` as ``step``: planned and captured now, written by the
        tier's thread; None when skipped (the previous fast save still in flight)."""
        if self._closed:
            raise RuntimeError("this fast tier is closed")
        step_dir(step)
        if self._busy.is_set():
            self.skipped += 1
            log.info("flexckpt fast tier: step %d skipped (the previous fast save is still in flight; %d skipped)",
                     step, self.skipped)
            return None
        shared = self.staging.share_staged(step, state)  # the persistent save of this step: its capture and bytes
        if shared is not None:
            entry, srcs, plain, lanes, per_rank, keyed = (shared.entry, None, shared.plain, shared.lanes,
                                                          shared.per_rank, shared.keyed)
        else:
            w = walk(state, self.rank, self.world)
            entry = self.staging.plan_for(w)
            srcs, plain, lanes, per_rank = self.staging.capture(w, entry)  # now: the pipeline moves on
            keyed = dict(w.keyed)
        if not self._space_checked:
            try:
                self._check_space(entry.rank_plan.nbytes)
            except BaseException:
                if shared is not None:
                    self.staging.release(shared.buffer)
                raise
            self._space_checked = True
        if not self._run_written and self.rank == 0:  # the run folder's record: made with rank 0's first fast save
            try:
                write_run_folder(self.host.storage, self.folder_run_id, self.launch)
            except BaseException:
                if shared is not None:
                    self.staging.release(shared.buffer)
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
        release = None if shared is None else functools.partial(self.staging.release, shared.buffer)
        self._jobs.put(FastJob(step, attempt, handle, entry, srcs, plain, lanes, per_rank, copy, keyed, shared, release,
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
                    log.warning("flexckpt fast tier rank %d: %d fast saves in a row failed; the tier is not protecting "
                                "the run (it holds step(s) %s of this rank's saves)", self.rank, self.failing,
                                self.holdings.steps())
                self._busy.clear()
                job.handle._fail(exc)
            finally:
                job.srcs = None
                job.let_go()  # (already, unless it failed before its data file was written)
                # not _busy.clear() here: _save_one cleared it before its handle said done, and
                # the next fast save may have set it since (its job then waits in the queue)

    def _save_one(self, job: FastJob) -> None:
        """Stage, write this rank's files and marker into the node's folder, then send a
        copy to each partner; the handle says done (or the caller reports the failure)."""
        e, h = job.entry, job.handle
        t0 = time.perf_counter()
        stream = staged_stream(job, self._buffer)
        h.timings["stage_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        self.holdings.prune(self.rank, self.config.keep_last - 1)  # room for this step: keep_last steps at most
        own = write_own(self.storage, job, stream, self.rank)
        fingerprint, carried = self._structure.of(e)
        doc = {
            "lineage": self.lineage, "fingerprint": fingerprint, "saved_fingerprint": e.fingerprint,
            "step": job.step, "attempt": job.attempt, "rank": self.rank, "world_size": self.world,
            "run_id": self.run_id, "launch": self.launch, "branch": job.branch, "line": own.line, "lanes": job.lanes,
            "plain": job.plain, "per_rank_keys": e.per_rank_keys, **carried,
            **({"keyed": keyed_entries(self.rank, job.keyed)} if job.keyed else {}),
            "files": {rel: memoryview(b).nbytes for rel, b in own.files.items()}, "chunks": own.chunks,
        }
        meta = orjson.dumps(doc)
        self.storage.put_atomic(f"{step_dir(job.step)}/{done_name(job.attempt, self.rank, self.world)}", meta,
                                fsync=False)
        self.holdings.wrote(doc)
        h.timings["write_s"] = time.perf_counter() - t1
        self.saved += 1
        t2 = time.perf_counter()
        self._replicate(job, doc, meta, list(own.files.values()))
        h.timings["replicate_s"] = time.perf_counter() - t2
        h.timings["bytes"] = float(e.rank_plan.nbytes)
        if self.failing:
            log.warning("flexckpt fast tier rank %d: step %d saved after %d failed fast save(s): the tier protects the "
                        "run again", self.rank, job.step, self.failing)
            self.failing = 0
        h.timings["failed_in_a_row"] = 0.0
        self._busy.clear()
        h._succeed()

    def _replicate(self, job: FastJob, doc: dict, meta: bytes, files: list) -> None:
        """A copy of the saved files to each live partner, sent from where they are (the
        node's data file, mapped; the table and values): no packed copy. A partner that
        fails is dropped for the tier's life; the local copy stands."""
        if not self.partners:
            return
        header = Header(job.step, int(job.attempt.rsplit(".", 1)[1]), self.global_ranks[self.rank],
                        len(meta) + sum(doc["files"].values()), digest(meta), 0, len(meta))
        for p in self.partners:
            if p in self._dead_partners:
                continue
            seq = self._seq.get(p, 0)
            try:
                send(self.group, self.store, "copy", self.global_ranks[p], header._replace(seq=seq), meta, files,
                     self.timeout)
                self._seq[p] = seq + 1
                self.replicated += 1
            except Exception as exc:  # noqa: BLE001 - a partner gone; the local copy stands
                self._dead_partners.add(p)
                self.replication_failures += 1
                log.error("flexckpt fast tier rank %d: copy of step %d to rank %d failed: %s", self.rank, job.step, p, exc)

    def _discard(self, job: FastJob) -> None:
        """What a failed fast save wrote of this rank's files (a full tmpfs must not keep it
        full): its marker first, then its files, then its folders if empty."""
        names = [f(job.attempt, self.rank) for f in (data_name, table_name, values_name)]
        try:
            remove_bundle(self.storage, job.step, done_name(job.attempt, self.rank, self.world), names)
        except Exception as exc:  # noqa: BLE001 - the failure is reported already; a close() removes the rest
            log.warning("flexckpt fast tier rank %d: removing the failed save of step %d: %s", self.rank, job.step, exc)

    def _copier(self, e: Any) -> Any:
        """The staging copy for ``e``'s pieces, marked ready here on the training thread:
        the checkpointer's own staging copies (``flexckpt.save.staging.copies_for``)."""
        if e.device not in self._copies:
            self._copies[e.device] = copies_for(e.device)
        copies = self._copies[e.device]
        ready = copies.ready()
        return lambda dsts, srcs: copies.copy(dsts, srcs, ready)

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
        self.holdings.prune(doc["rank"], self.config.keep_last - 1)
        makedirs(self.storage, f"{folder}/{doc['attempt']}")
        marker = done_name(doc["attempt"], doc["rank"], doc["world_size"])
        try:
            for rel, data in files:
                self.storage.put_atomic(f"{folder}/{rel}", data, fsync=False)
            self.storage.put_atomic(f"{folder}/{marker}", orjson.dumps(doc), fsync=False)
        except BaseException:  # a full tmpfs: the copy's files go (the inbox reports the failure)
            remove_bundle(self.storage, doc["step"], marker, [rel for rel, _ in files])
            raise
        self.holdings.wrote(doc)

    def wait(self, timeout: float | None = None) -> None:
        """Until this rank's fast save in flight, if any, is done (TimeoutError after ``timeout`` s)."""
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
        folders = self.all_gather((self.node, self.folder_id))
        if self.rank == folders.index((self.node, self.folder_id)):
            self.sweep(set_aside(self.root, -1))
        self.holdings.forget()

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
        return max((s for s in self.all_gather(mine) if s is not None), default=None)

    def recover(self, state: dict, strict: bool, exclude: tuple[str, ...] = ()) -> tuple[int, LoadStats] | None:
        """Restore the newest step complete across the surviving nodes into ``state``
        (every rank calls it, as ``load()`` is): ``(step, load stats)``, or None when the
        persistent store must serve the load (the reason is in ``last_recovery``).
        ``exclude`` as ``load()`` takes it: those leaves are left out of the structure
        compared and of the load."""
        outcome, self.last_recovery = StepRecovery(self, self.host).run(state, strict, exclude)
        return outcome

    def sweep(self, paths: list[str]) -> None:
        """Remove set-aside step folders on a thread of their own (``close()`` waits for it)."""
        if paths:
            sweeper = threading.Thread(target=remove_paths, args=(paths,), name=f"flexckpt-tier-sweep-r{self.rank}",
                                       daemon=True)
            sweeper.start()
            self._sweepers.append(sweeper)

    def all_gather(self, obj: Any) -> list:
        """``obj`` of every rank, by rank (one all-gather on the tier's group)."""
        if self.group is None:
            return [obj]
        out: list = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out


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
