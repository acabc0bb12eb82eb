"""The checkpointer: ``save`` stages into reused buffers and returns; background threads
write, and the coordinator commits. ``load`` restores at any world size.

This module is the facade: construction, ``save``/``save_local``/``load``/``check``,
``wait``/``close``, ``steps``/``contents``. The rest lives where a reader looks for it:
  save_pipeline - planning and capture on the training thread, the staging and writing
                  threads (``SavePipeline``), attempt numbering (``Attempts``);
  committer     - the commit thread of rank 0 and the group leaders, failure reports, and
                  the other ranks' wait for the commit (``Committer``; pure steps in commit);
  handle        - ``SaveHandle``, what a save returns;
  agree         - the collectives of load (the step, the first failed rank);
  savers        - who saves (``ranks=``), and the ids they agree on at construction, through
                  the process group's store rather than a collective;
  tier          - the fast tier (``local=``), composed here.
No thread ever enters a collective on the save path.
"""
from __future__ import annotations

import atexit
import functools
import logging
import queue
import threading
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist

from flexckpt.agree import agree_step, distributed, first_failed_rank
from flexckpt.codec import parse_compression
from flexckpt.commit import committed_steps, read_manifest, reclaim_at_start
from flexckpt.committer import Committer
from flexckpt.contents import Contents, read_contents
from flexckpt.errors import LoadError
from flexckpt.exchange import Fanout, PeerFailure
from flexckpt.fanout import wanted
from flexckpt.handle import SaveHandle
from flexckpt.load import LoadStats, PendingLoad
from flexckpt.manifest import GROUP, step_dir
from flexckpt.rebuild import load_dict
from flexckpt.savers import run_ids, who_saves
from flexckpt.save_pipeline import Attempts, PlanEntry, SaveJob, SavePipeline, stop_threads
from flexckpt.staging import BufferPool, copies_for
from flexckpt.storage import DEFAULT_STALL_TIMEOUT, Storage
from flexckpt.structure import check_state, excluder, walk
from flexckpt.tier import LocalTier
from flexckpt.tier.fast import FastTier
from flexckpt.writer import RawSums
from flexshard import current_world

log = logging.getLogger("flexckpt")

DEFAULT_CHUNK_BYTES = 2 << 20
DEFAULT_EXIT_TIMEOUT = 30.0
CLOCK_SKEW = 5.0  # seconds an object store's timestamps may differ from this host's clock

__all__ = ["Checkpointer", "SaveHandle"]


class Checkpointer(SavePipeline, Committer):
    """Async checkpoints of a training state under one storage URL.

    Args:
        url: ``file:///path``, a plain path, ``memory://name`` (one process only) or
            ``s3://bucket/prefix`` (``storage_options`` go to fsspec, e.g. an endpoint).
        keep_last: keep only the newest N committed checkpoints (None keeps all), and
            the steps in the attribute ``pinned`` besides (a set of steps the caller may
            replace at any time, e.g. with a trainer's best step; retention reads it at
            each commit).
        compression: None, ``"zstd"`` or ``"zstd:LEVEL"``, applied per chunk.
        max_in_flight: staging buffers, i.e. saves staged but not yet written; a save
            beyond that waits (bounded memory).
        chunk_bytes: raw bytes per chunk; each is compressed and checksummed alone.
        run_id: the same string on every rank of this job; by default taken from
            ``FLEXCKPT_RUN_ID`` or torchrun's run id and restart count, else the first saving
            rank's random id, shared here through the process group's key-value store (no
            collective: see :mod:`flexckpt.savers`).
        rank, world_size: override the ``torch.distributed`` world (both or neither).
        ranks: the ranks of the process group (of ``process_group``, else the default group)
            that save, when not all of them: ``ranks=[0]`` saves from rank 0 alone, as
            Lightning's DDP and other frameworks do, while the other ranks never touch flexckpt
            (construction returns at once, the commit waits for rank 0 only). Made with the
            same argument on a rank not named, the Checkpointer only reads there (``save``
            raises; ``load`` reads the whole checkpoint on that rank alone, as a world of one,
            with no collective; to load each rank's part per its layouts, construct one
            without ``ranks=`` on every rank and load together). One rank or all of them; for another subset pass a
            ``process_group`` of exactly those ranks. Not with ``rank=``/``world_size=``,
            nor with ``local=`` unless it names every rank.
        commit_timeout: seconds the coordinator waits for the other ranks' records (and the
            other ranks for the commit, and for the first saving rank's ids at construction).
        exit_timeout: at interpreter exit, seconds to wait for saves in flight before
            leaving without them (default 30; a save whose ranks never all arrive would
            otherwise hold the exit for ``commit_timeout``).
        fsync: make files durable before the commit (turn off only for throwaway runs).
        read_threads: parallel ranged reads during load.
        poll_interval: longest pause between the listings that wait for other ranks'
            records (rank 0) or for the manifest (other ranks); default 10 ms on a local
            filesystem, 100 ms on an object store (each listing is a request there).
        direct_io: write uncompressed data files on a local filesystem with O_DIRECT, from
            the staging buffer straight to the device (much less CPU than going through the
            page cache); falls back to ordinary writes where the filesystem refuses.
        stage_delay: seconds the staging copy waits after save() returns (cut short by the
            fence), so that it does not compete for cores and memory bandwidth with the
            other ranks' save() calls, which data-parallel ranks make within about a
            millisecond of each other; default 3 ms (figures: bench/RESULTS.md, "What changed
            since the first run").
        stall_timeout: seconds any one storage call may go without progress (bytes moved)
            before it is given up; the save then fails on its handle with ``SaveError`` and
            training goes on (None: wait for ever).
        local: a fast tier (:class:`flexckpt.tier.LocalTier`): ``save_local`` writes to
            node-local memory with a copy on a peer node; ``load()`` restores from it first.
        read_only: open ``url`` to read it (``load``, ``steps``, ``contents``) and change
            nothing there: no start-up housekeeping (the coordinator's removal of stale
            save attempts), and ``save`` is refused. For tools beside a live job or with
            read-only credentials (the CLI's exports, a reshard's source, ``flextrain plan``).
            Not with ``local=``.
        fanout: at load, each stored chunk that several ranks need (replicas: HSDP's
            replicate dim, DDP, tensor-parallel norms) is read from the store by one of
            them and sent to the others over the process group, so that the job reads each
            stored byte once. ``"auto"`` (default): when the store is remote (``s3://``;
            not a local folder) and the group runs on gloo; ``True``: whenever several
            ranks load (an NCCL group is refused); ``False``: never. A peer that fails or
            dies fails the load on every rank within ``flexckpt.exchange.PEER_TIMEOUT``
            (60 s), naming it. ``last_load_stats.bytes_from_store``/``bytes_from_peers``
            count where each rank's bytes came from.

    Construction on several ranks never enters a collective: the ids are shared through the
    store and a rank that waits for them names the rank it waits for when it gives up. A fast
    tier (``local=``) still needs every rank; a rank that never comes ends in a timeout
    (``LocalTier.timeout``) that names it.
    """

    def __init__(
        self,
        url: str,
        *,
        keep_last: int | None = None,
        compression: str | None = None,
        max_in_flight: int = 1,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        run_id: str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        ranks: "list[int] | None" = None,
        commit_timeout: float = 600.0,
        exit_timeout: float = DEFAULT_EXIT_TIMEOUT,
        storage_options: dict[str, Any] | None = None,
        fsync: bool = True,
        read_threads: int = 2,
        poll_interval: float | None = None,
        direct_io: bool = True,
        stage_delay: float = 0.003,
        process_group: "dist.ProcessGroup | None" = None,
        stall_timeout: float | None = DEFAULT_STALL_TIMEOUT,
        local: "LocalTier | None" = None,
        read_only: bool = False,
        fanout: "str | bool" = "auto",
    ) -> None:
        if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
            raise ValueError(f"keep_last must be None or an int >= 1, got {keep_last!r}")
        if not isinstance(chunk_bytes, int) or not 64 <= chunk_bytes <= 256 << 20:
            raise ValueError(f"chunk_bytes must be an int in [64, 256 MiB], got {chunk_bytes!r}")
        if not (fanout is True or fanout is False or fanout == "auto"):
            raise ValueError(f"fanout must be 'auto', True or False, got {fanout!r}")
        self.fanout = fanout
        if read_only and local is not None:
            raise ValueError("read_only=True writes nothing, and a fast tier (local=) saves: drop one of them")
        self.group = process_group
        who = who_saves(rank, world_size, ranks, process_group)
        if local is not None and who.subset:
            raise ValueError(f"a fast tier (local=) needs every rank of the group, and ranks={list(who.named)!r} "
                             f"leaves some out: drop local= or ranks=")
        self.saves = who.saves
        self.read_only = bool(read_only) or not who.saves  # a rank outside ranks= only reads
        self.rank, self.world_size = who.rank, who.world_size
        self.storage = Storage(url, storage_options, stall_timeout)
        if self.world_size > 1 and self.storage.fs.protocol in ("memory", ("memory",)):
            raise ValueError(
                f"{url!r}: memory:// lives inside one process; a {self.world_size}-rank job needs a shared "
                f"folder (file://) or an object store (s3://)"
            )
        self.keep_last = keep_last
        self.pinned: frozenset[int] = frozenset()
        self.compression = parse_compression(compression)
        self.chunk_bytes = chunk_bytes
        self.commit_timeout = float(commit_timeout)
        self.exit_timeout = float(exit_timeout)
        self.fsync = fsync
        self.read_threads = max(1, int(read_threads))
        self.direct_io = bool(direct_io)
        if not 0 <= stage_delay <= 1:
            raise ValueError(f"stage_delay must be in [0, 1] seconds, got {stage_delay!r}")
        self.stage_delay = float(stage_delay)
        self.poll_interval = float(poll_interval) if poll_interval is not None else (0.01 if self.storage.local else 0.1)
        self.is_coordinator = self.rank == 0
        self.is_leader = self.rank % GROUP == 0  # gathers its group's records (rank 0: everyone's)
        self.run_id, self.session = run_ids(run_id, who, self.commit_timeout)
        self._attempts = Attempts(self.run_id, self.session)
        # files of another job written after this instant mean a live job on the same URL;
        # object stores stamp files with their own clock: allow for skew
        self._since = time.time() - (0.0 if self.storage.local else CLOCK_SKEW)
        self._listed_steps: set[str] = set()  # step folders the live-job check listed (commit thread)
        if self.is_coordinator:  # after the collectives above: the other ranks fail at their first call
            self.storage.probe()  # a store that cannot work fails here, in one line (one listing)
        self.last_load_stats: LoadStats | None = None
        self.tier = None if local is None else FastTier(local, self)
        self._pool = BufferPool(max_in_flight)
        self._plan_key: list | None = None
        self._plan_entry: PlanEntry | None = None
        # the coordinator: every structure the records carried (fingerprint -> structure), and
        # the last union of differing ones (pipeline stages) with its plan
        self._structures: dict[str, dict] = {}
        self._union: tuple | None = None
        self._plan_ids = 0
        self._stage_q: queue.Queue = queue.Queue()
        self._write_q: queue.Queue = queue.Queue()
        self._commit_q: queue.Queue = queue.Queue()
        self._threads: list[threading.Thread] = []
        self._handles: list[SaveHandle] = []
        self._last_save: SaveJob | None = None
        self._closed = False
        self._copies: dict[torch.device, Any] = {}  # staging copies by device (copies_for)
        self._lock = threading.Lock()
        # held by retention, and by a writer while it makes a save's folders: a save either
        # made them before retention began (and is in flight, which retention leaves alone)
        # or makes them after it ended (never into an empty step folder being removed)
        self._folders_lock = threading.Lock()
        self._reclaim: threading.Thread | None = None
        if self.is_coordinator and not self.read_only:  # a reader changes nothing under url
            # on a thread of its own: construction (and a fast tier's recovery) never waits for it;
            # it holds _folders_lock, so the first save makes its folders once it is done
            self._reclaim = threading.Thread(target=self._reclaim_at_start, name="flexckpt-reclaim", daemon=True)
            self._reclaim.start()
        ref = weakref.ref(self)
        self._atexit = lambda: (ref() and ref().close(timeout=ref().exit_timeout, _at_exit=True))
        atexit.register(self._atexit)
        # dropped without close(): the threads hold only a weak reference, so it is freed,
        # and this stops them (saves still queued then are abandoned)
        stop = weakref.finalize(self, stop_threads, (self._stage_q, self._write_q, self._commit_q), self._atexit)
        stop.atexit = False  # at exit, close() above waits for the saves in flight instead

    def _reclaim_at_start(self) -> None:
        """Files of saves that failed or were cut short before this launch (see
        :func:`flexckpt.commit.reclaim_at_start`): a restarted job on a full disk saves again.
        Runs on its own thread, started at construction (a load, a fast tier's recovery
        included, never waits for it; the first save makes its folders once it is done,
        ``close()`` waits for it)."""
        try:
            with self._folders_lock:
                removed = reclaim_at_start(self.storage, self.run_id, self.commit_timeout, self._since,
                                           f"{self.run_id}.{self.session}")
        except Exception:  # noqa: BLE001 - housekeeping; saves report their own failures
            log.exception("flexckpt: reclaiming unfinished saves under %s failed", self.storage.url)
            return
        if removed:
            log.info("flexckpt: removed %d unfinished save attempt(s): %s", len(removed), removed[:10])

    # -- saving --------------------------------------------------------------------------------
    def save(self, step: int, state: dict) -> SaveHandle:
        """Start saving ``state`` as ``step``; returns once the copy is queued.

        Call ``handle.wait_staged()`` before changing the state (the optimizer step).
        Storage failures are reported by the handle and the log, never raised here; a
        state that cannot be checkpointed at all raises at once, on this thread, before
        anything is written: ``UnsupportedState`` listing every such leaf (see :meth:`check`).
        Several saves may be in flight, in any step order and from several threads: they
        commit in the order of the save() calls, retention never removes a save in flight
        (a smaller step saved while a larger one commits), and keep_last never removes the
        step a commit just wrote (a step older than the newest goes at the next commit).
        """
        t0 = time.perf_counter()
        if self._closed:
            raise RuntimeError("this Checkpointer is closed")
        if not self.saves:
            raise RuntimeError(f"rank {current_world(self.group)[0]} does not save: this Checkpointer of "
                               f"{self.storage.url} was made with ranks= naming the ranks that do; it loads here")
        if self.read_only:
            raise RuntimeError(f"this Checkpointer of {self.storage.url} was opened read_only=True: open one "
                               f"without read_only to save")
        step_dir(step)  # validates the step
        w = walk(state, self.rank, self.world_size)
        entry = self._plan_for(w)
        srcs, plain, lanes, per_rank = self._capture(w, entry)
        attempt = self._attempts.next(step)  # the same save on every rank (see Attempts)
        waiter = None if self.is_coordinator else functools.partial(self._wait_for_commit, attempt=attempt)
        handle = SaveHandle(step, waiter, attempt)
        copies = self._copies.get(entry.device)
        if copies is None:
            copies = self._copies[entry.device] = copies_for(entry.device)
        ready = copies.ready()  # an event on the training stream; the copies run on the staging thread
        self._ensure_threads()
        t_wait = time.perf_counter()
        buffer = self._pool.acquire()  # waits while max_in_flight saves are staged but not written
        handle.timings["buffer_wait_s"] = time.perf_counter() - t_wait
        job = SaveJob(step, handle, entry, buffer, srcs, plain, lanes, per_rank, ready, attempt, keyed=dict(w.keyed),
                      lease=buffer.lease, state_id=id(state),
                      sums=RawSums() if self.compression.codec == "none" else None,
                      tree=w.tree if self.is_coordinator else None)
        with self._lock:
            self._handles = [h for h in self._handles if not h.done()] + [handle]
            self._last_save = job  # a fast save of the same step and state takes its bytes (_share_staged)
        self._stage_q.put(job)
        handle.save_seconds = time.perf_counter() - t0
        return handle

    def save_local(self, step: int, state: dict) -> SaveHandle | None:
        """A fast-tier save of ``state`` as ``step`` (see ``local=``); None when skipped
        because the previous fast save is still in flight (counted in ``tier.skipped``).

        Called for the step and the same ``state`` object as the last :meth:`save`, it
        takes that save's capture and staged bytes (one walk, one staging copy; its
        ``wait_staged()`` is that save's fence): the state must not change between the two
        calls, as it must not before the fence."""
        if self.tier is None:
            raise ValueError("save_local needs a fast tier: Checkpointer(url, local=LocalTier(...))")
        return self.tier.save(self, step, state)

    def wait(self, timeout: float | None = None) -> None:
        """Wait until every save started so far has finished on this rank, retention after
        the last commit included (errors stay on their handles)."""
        with self._lock:
            handles = list(self._handles)
        deadline = None if timeout is None else time.monotonic() + timeout
        for h in handles:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not h._done.wait(left):
                raise TimeoutError(f"save of step {h.step} still in flight after {timeout} s")
        if self.is_coordinator and self._threads:
            self._commit_q.join()  # retention of the last commit, too

    def close(self, timeout: float | None = None, *, keep_tier: bool = False, _at_exit: bool = False) -> None:
        """Wait for saves in flight, then stop the background threads. A fast tier's node
        folder is removed here (a clean exit), not when the interpreter exits without
        close() (a crash, whose restart needs it), nor with ``keep_tier`` (a job whose newest
        step may be the tier's only: one that failed, or stopped without saving)."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._atexit)
        if self._threads:
            self._stage_q.put(None)
            deadline = None if timeout is None else time.monotonic() + timeout
            for t in self._threads:
                t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        self._threads = []
        if self._reclaim is not None:
            self._reclaim.join(timeout)
        if self.tier is not None:  # first: a fast save in flight may hold a staging buffer
            self.tier.close(remove=not (_at_exit or keep_tier))
        self._last_save = None
        self._pool.clear()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(_at_exit=exc[0] is not None)  # leaving on an exception keeps the fast tier

    # -- listing -------------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """Committed steps, ascending."""
        return committed_steps(self.storage)

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def contents(self, step: int | None = None) -> Contents:
        """What the newest committed step (or ``step``) holds, each leaf by its key path (a
        tuple of str and int keys, see :mod:`flexckpt.contents`): tensors' dtypes, global
        shapes and saved layouts, plain values, per-lane, per-rank and bytes values. Load
        single tensors with ``load({...: tensor}, step, strict=False)``, or everything
        without a template with :meth:`load_dict`."""
        return read_contents(self.storage, self._committed(step))

    def _committed(self, step: int | None) -> int:
        """``step``, or the newest committed step; LoadError if it is not committed."""
        steps = self.steps()
        chosen = (steps[-1] if steps else None) if step is None else step
        if chosen is None:
            raise LoadError(f"no committed checkpoint under {self.storage.url}: nothing to load yet (save one first, "
                            f"or check the URL)")
        if chosen not in steps:
            raise LoadError(f"step {step} is not a committed checkpoint under {self.storage.url}; committed: {steps}")
        return chosen

    # -- checking --------------------------------------------------------------------------------
    def check(self, state: dict) -> None:
        """Raise ``UnsupportedState`` listing every leaf of ``state`` that cannot be
        checkpointed (its name, its type, for a DTensor its mesh and placements, and the
        fix), all in one error. Call it at the start of training, before the first step:
        it walks the state exactly as ``save`` does (the same code decides), writes
        nothing and makes no collective."""
        check_state(state, self.rank, self.world_size)

    # -- loading -------------------------------------------------------------------------------
    def load(self, state: dict, step: int | None = None, *, strict: bool = True, fallback: bool = False,
             exclude: tuple[str, ...] = ()) -> int:
        """Restore ``state`` in place from the newest committed step (or ``step``).

        Works at any world size: each rank reads only the byte ranges its pieces need.
        With ``torch.distributed`` initialized, rank 0 picks the step for everyone, and a
        failure on any rank fails the load on all; ``fallback=True`` then tries the
        previous committed step, on all ranks together. ``strict=False`` loads what the
        checkpoint and the state share and leaves the rest unchanged. Everything is
        validated before the ranks agree on success, and plain, per-lane and per-rank values
        are set only after they agreed: a failed load leaves them unchanged on every rank,
        but target tensors (read in place) may have been partly overwritten.

        ``exclude`` takes leaves out of the load by name pattern (``fnmatch``; a pattern
        that matches a container takes all below it): ``exclude=("data/*",)`` or
        ``("data",)``, or by key path, ``exclude=(("data",),)`` (see :mod:`flexckpt.contents`).
        They keep what the state holds, and the checkpoint need not have
        them; a stateful object whose own name is excluded is not loaded at all. Without
        it, a key the state holds and the checkpoint lacks stops the load naming the key,
        whatever its kind: a tensor, a plain, per-lane or ``bytes`` value, or a per-rank
        value at another world size (``strict=False`` skips all such keys at once).

        With a fast tier (``local=``), ``load(state)`` restores from the tier when it holds
        the newest step (``exclude`` too). ``load(state, step=N)`` and ``strict=False`` read
        the store only, even where the tier holds a newer step; after them, what this job
        saves to the tier outranks every step the tier holds (the run may go on from the
        store's step). ``step=N`` (a rollback) also sets the tier's steps aside;
        ``strict=False`` (a probe of plain values, single tensors) leaves them, for a
        ``load(state)`` that follows. To take leaves out of a restore from the tier, use
        ``exclude``, not ``strict=False``.
        """
        if self._closed:
            raise RuntimeError("this Checkpointer is closed")
        gone = excluder(exclude)  # a malformed pattern list raises here, on every rank alike
        self.wait()
        if self.tier is not None and step is None and strict:  # load(step=...) and partial loads bypass it
            self.tier.wait()
            restored = self.tier.recover(self, state, strict, exclude)
            if restored is not None:
                return restored
        w = walk(state, self.rank, self.world_size)
        chosen = self._agree_step(step, before=None)
        while True:
            error: BaseException | None = None
            pending = None
            fan = self._fanout()
            try:
                manifest = read_manifest(self.storage, chosen)
                pending = PendingLoad(self.storage, manifest, w, self.rank, self.world_size, strict, gone)
                pending.read(self.read_threads, fan)
            except Exception as exc:  # noqa: BLE001 - every rank must reach the agreement below
                error = exc
                if fan is not None:
                    fan.join_failed()  # a rank that failed before the fan-out's gather still joins it
            try:
                failed_rank = self._first_failed_rank(error is not None, isinstance(error, PeerFailure))
            except Exception:  # noqa: BLE001 - a peer that died breaks the agreement too: name it, not the group
                if isinstance(error, PeerFailure):
                    raise error from None
                raise
            if failed_rank is None:
                assert pending is not None
                pending.apply()
                self.last_load_stats = pending.stats
                if self.tier is not None and (step is not None or not strict):
                    self.tier.abandon(aside=step is not None)  # no tier step may outrank what the run saves next
                return chosen
            if error is not None and fallback:  # handled, not raised: say what failed (raised: never logged too)
                log.warning("flexckpt rank %d: load of step %d failed: %s", self.rank, chosen, error)
            if not fallback:
                if error is not None:
                    raise error
                raise LoadError(f"load of step {chosen} failed on rank {failed_rank}; see that rank's error")
            previous = chosen
            chosen = self._agree_step(None, before=previous)
            log.warning("flexckpt: load of step %d failed; falling back to step %d", previous, chosen)

    def load_dict(self, step: int | None = None, *, device: "str | torch.device" = "cpu",
                  exclude: tuple = ()) -> dict:
        """The state saved as the newest committed step (or ``step``), rebuilt without a
        template: the same dicts (str and int keys, in order), lists, tuples and plain values
        (see :mod:`flexckpt.plain`), ``bytes``, and every tensor whole on ``device`` (a
        DTensor too; load into a template with :meth:`load` to get pieces). Tensors that
        shared storage come back as separate tensors. See :mod:`flexckpt.rebuild`.

        No collective: each rank reads on its own (pass ``step=`` so that ranks loading
        while a save commits agree). ``exclude`` leaves keys out by key path (a tuple such
        as ``("data",)`` or ``("opt", "state", 0)``: that key and all below it) or by name
        pattern as :meth:`load` takes them; an excluded list item is left out of its list.
        """
        if self._closed:
            raise RuntimeError("this Checkpointer is closed")
        gone = excluder(exclude)
        self.wait()
        chosen = self._committed(step)
        manifest = read_manifest(self.storage, chosen)
        return load_dict(self.storage, manifest, self.rank, self.world_size, torch.device(device), gone,
                         self.read_threads)

    def _agree_step(self, step: int | None, before: int | None) -> int:
        return agree_step(self.rank, self.world_size, self.group, self.steps, self.storage.url, step, before)

    def _first_failed_rank(self, failed: bool, by_peer: bool = False) -> int | None:
        return first_failed_rank(self.rank, self.world_size, self.group, failed, by_peer)

    def _fanout(self) -> "Fanout | None":
        """This load's fan-out (:func:`flexckpt.fanout.wanted`), or None: decided alike on every rank."""
        if not distributed(self.world_size):
            return None
        if not wanted(self.fanout, self.world_size, self.storage.local, self.storage.url, dist.get_backend(self.group)):
            return None
        return Fanout(self.rank, self.world_size, self.group)  # exchange.PEER_TIMEOUT
