"""The checkpointer: ``save`` stages into reused buffers and returns; background threads
write, and the coordinator commits. ``load`` restores at any world size.

This module is the facade: construction, ``save``/``save_local``/``load``/``check``,
``wait``/``close``, ``steps``/``contents``. It owns its parts and hands each call on:
  save.pipeline  - ``SavePipeline``: planning and capture on the training thread, the staging
                   and writing threads, attempt numbering (``Attempts``);
  save.committer - ``Committer``: the commit thread of rank 0 and the group leaders, records,
                   failure reports, the other ranks' wait for the commit (pure steps in
                   ``save.commit``, retention and reclaim in ``save.cleanup``);
  save.job       - the settings both share, and the job a save is on its way;
  save.handle    - ``SaveHandle``, what a save returns, and ``InFlight``, the saves not yet done;
  save.savers    - who saves (``ranks=``), and the ids they agree on at construction, through
                   the process group's store rather than a collective;
  load.committed - the store's load: the step agreed, read, success agreed, the fallback;
  load.rebuild   - ``load_dict``, a saved state without a template;
  tier           - the fast tier (``local=``), given this rank's identity and store as its
                   host (``tier.seam.TierHost``, values) and the pipeline as its staging.
No thread holds the Checkpointer, and none ever enters a collective on the save path.
"""
from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist

from flexckpt.catalog import committed_steps, read_manifest
from flexckpt.contents import Contents, read_contents
from flexckpt.errors import LoadError
from flexckpt.format.codec import parse_compression
from flexckpt.format.names import GROUP, step_dir
from flexckpt.load.committed import load_committed
from flexckpt.load.fetch import read_threads_for
from flexckpt.load.pending import LoadStats
from flexckpt.load.rebuild import load_dict
from flexckpt.save.committer import Committer
from flexckpt.save.handle import InFlight, SaveHandle
from flexckpt.save.job import SaveSettings
from flexckpt.save.pipeline import SavePipeline, stop_on_collect
from flexckpt.save.savers import Savers, run_ids, who_saves
from flexckpt.state.structure import check_state, excluder, walk
from flexckpt.storage import DEFAULT_STALL_TIMEOUT, Storage
from flexckpt.tier import LocalTier
from flexckpt.tier.fast import FastTier
from flexckpt.tier.seam import TierHost
from flexshard import current_world

log = logging.getLogger("flexckpt")

DEFAULT_CHUNK_BYTES = 2 << 20
DEFAULT_EXIT_TIMEOUT = 30.0
CLOCK_SKEW = 5.0  # seconds an object store's timestamps may differ from this host's clock

__all__ = ["Checkpointer", "SaveHandle"]


class Checkpointer:
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
            collective: see :mod:`flexckpt.save.savers`).
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
        read_threads: parallel ranged reads during load (default None: 2, but 1 from a
            local filesystem when this node has fewer than 2 CPUs per local rank, its
            ``LOCAL_WORLD_SIZE`` as torchrun sets it: a local read is a copy and a checksum,
            and threads beyond the cores only contend; see ``load.fetch.read_threads_for``).
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
            ranks load (an NCCL group is refused); ``"nccl"``: whenever several ranks load,
            over an NCCL group (each message copied to the GPU to travel and back to the
            host, where its chunks are checked and placed); ``False``: never. A peer that fails or
            dies fails the load on every rank within ``flexckpt.load.exchange.PEER_TIMEOUT``
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
        read_threads: int | None = None,
        poll_interval: float | None = None,
        direct_io: bool = True,
        stage_delay: float = 0.003,
        process_group: "dist.ProcessGroup | None" = None,
        stall_timeout: float | None = DEFAULT_STALL_TIMEOUT,
        local: "LocalTier | None" = None,
        read_only: bool = False,
        fanout: "str | bool" = "auto",
    ) -> None:
        check_arguments(keep_last=keep_last, chunk_bytes=chunk_bytes, stage_delay=stage_delay, read_only=read_only,
                        local=local)
        if not (fanout is True or fanout is False or fanout in ("auto", "nccl")):
            raise ValueError(f"fanout must be 'auto', True or False, got {fanout!r} (or 'nccl': over an NCCL group)")
        self.fanout = fanout
        self.group = process_group
        who = who_saves(rank, world_size, ranks, process_group)
        check_savers(who, local)
        self.saves = who.saves
        self.read_only = bool(read_only) or not who.saves  # a rank outside ranks= only reads
        self.rank, self.world_size = who.rank, who.world_size
        self.storage = Storage(url, storage_options, stall_timeout)
        check_shared(url, self.storage, self.world_size)
        self.commit_timeout = float(commit_timeout)
        self.exit_timeout = float(exit_timeout)
        self.read_threads = read_threads_for(self.storage.local) if read_threads is None else max(1, int(read_threads))
        self.is_coordinator = self.rank == 0
        self.is_leader = self.rank % GROUP == 0  # gathers its group's records (rank 0: everyone's)
        self.run_id, self.session = run_ids(run_id, who, self.commit_timeout)
        if self.is_coordinator:  # after the collectives above: the other ranks fail at their first call
            self.storage.probe()  # a store that cannot work fails here, in one line (one listing)
        self.last_load_stats: LoadStats | None = None
        self._closed = False
        settings = SaveSettings(
            storage=self.storage, rank=self.rank, world_size=self.world_size, run_id=self.run_id,
            session=self.session, compression=parse_compression(compression), chunk_bytes=chunk_bytes,
            fsync=bool(fsync), direct_io=bool(direct_io), stage_delay=float(stage_delay),
            commit_timeout=self.commit_timeout,
            poll_interval=float(poll_interval) if poll_interval is not None else (0.01 if self.storage.local else 0.1),
        )
        self._build_parts(settings, keep_last, max_in_flight, local)
        self._reclaim = self._start_reclaim()
        self._atexit = self._end_with_process()

    def _build_parts(self, settings: SaveSettings, keep_last: int | None, max_in_flight: int,
                     local: LocalTier | None) -> None:
        """The committer, the save pipeline and the fast tier, each given what it needs."""
        self._in_flight = InFlight()
        # files of another job written after this instant mean a live job on the same URL;
        # object stores stamp files with their own clock: allow for skew
        since = time.time() - (0.0 if self.storage.local else CLOCK_SKEW)
        self._committer = Committer(settings, self._in_flight, keep_last=keep_last, since=since)
        self._pipeline = SavePipeline(settings, self._committer, self._in_flight, max_in_flight)
        # the tier's host is this rank's identity and store, as values: the tier holds no reference
        # to this facade (its thread must not keep a Checkpointer dropped without close() alive)
        host = TierHost(rank=self.rank, world_size=self.world_size, run_id=self.run_id, session=self.session,
                        storage=self.storage, group=self.group, read_threads=self.read_threads)
        self.tier = None if local is None else FastTier(local, host=host, staging=self._pipeline)

    def _start_reclaim(self) -> threading.Thread | None:
        """The coordinator removes the files of saves cut short before this launch on a thread
        of its own: construction (and a fast tier's recovery) never waits for it; it holds the
        committer's folders lock, so the first save makes its folders once it is done."""
        if not self.is_coordinator or self.read_only:  # a reader changes nothing under url
            return None
        reclaim = threading.Thread(target=self._committer.reclaim, name="flexckpt-reclaim", daemon=True)
        reclaim.start()
        return reclaim

    def _end_with_process(self) -> Any:
        """At interpreter exit, close() waits for the saves in flight (``exit_timeout``). Dropped
        without close(), this Checkpointer is freed (no thread holds it) and its finalizer
        stops the pipeline's threads; saves still queued then fail on their handles."""
        ref = weakref.ref(self)
        at_exit = lambda: (ref() and ref().close(timeout=ref().exit_timeout, _at_exit=True))  # noqa: E731
        atexit.register(at_exit)
        stop = weakref.finalize(self, stop_on_collect, self._pipeline, at_exit)
        stop.atexit = False  # at exit, close() above waits for the saves in flight instead
        return at_exit

    @property
    def keep_last(self) -> int | None:
        """Committed checkpoints retention keeps (read at each commit)."""
        return self._committer.keep_last

    @keep_last.setter
    def keep_last(self, n: int | None) -> None:
        self._committer.keep_last = n

    @property
    def pinned(self) -> frozenset[int]:
        """Steps retention keeps besides the newest ``keep_last`` (read at each commit)."""
        return self._committer.pinned

    @pinned.setter
    def pinned(self, steps: frozenset[int]) -> None:
        self._committer.pinned = steps

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
        handle = self._pipeline.save(step, state)
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
        return self.tier.save(step, state)

    def wait(self, timeout: float | None = None) -> None:
        """Wait until every save started so far has finished on this rank, retention after
        the last commit included (errors stay on their handles)."""
        self._pipeline.wait(timeout)

    def close(self, timeout: float | None = None, *, keep_tier: bool = False, _at_exit: bool = False) -> None:
        """Wait for saves in flight, then stop the background threads. A fast tier's node
        folder is removed here (a clean exit), not when the interpreter exits without
        close() (a crash, whose restart needs it), nor with ``keep_tier`` (a job whose newest
        step may be the tier's only: one that failed, or stopped without saving)."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._atexit)
        self._pipeline.finish(timeout)
        if self._reclaim is not None:
            self._reclaim.join(timeout)
        if self.tier is not None:  # first: a fast save in flight may hold a staging buffer
            self.tier.close(remove=not (_at_exit or keep_tier))
        self._pipeline.clear()

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
            restored = self.tier.recover(state, strict, exclude)
            if restored is not None:
                step_restored, self.last_load_stats = restored
                return step_restored
        w = walk(state, self.rank, self.world_size)
        chosen, self.last_load_stats = load_committed(
            self.storage, w, rank=self.rank, world_size=self.world_size, group=self.group, step=step,
            strict=strict, gone=gone, read_threads=self.read_threads, fallback=fallback, fanout=self.fanout)
        if self.tier is not None and (step is not None or not strict):
            self.tier.abandon(aside=step is not None)  # no tier step may outrank what the run saves next
        return chosen

    def load_dict(self, step: int | None = None, *, device: "str | torch.device" = "cpu",
                  exclude: tuple = ()) -> dict:
        """The state saved as the newest committed step (or ``step``), rebuilt without a
        template: the same dicts (str and int keys, in order), lists, tuples and plain values
        (see :mod:`flexckpt.state.plain`), ``bytes``, and every tensor whole on ``device`` (a
        DTensor too; load into a template with :meth:`load` to get pieces). Tensors that
        shared storage come back as separate tensors. See :mod:`flexckpt.load.rebuild`.

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


def check_arguments(*, keep_last: int | None, chunk_bytes: int, stage_delay: float, read_only: bool,
                    local: LocalTier | None) -> None:
    """The arguments that are wrong whatever the world: ValueError naming the value and the fix."""
    if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"keep_last must be None or an int >= 1, got {keep_last!r}")
    if not isinstance(chunk_bytes, int) or not 64 <= chunk_bytes <= 256 << 20:
        raise ValueError(f"chunk_bytes must be an int in [64, 256 MiB], got {chunk_bytes!r}")
    if read_only and local is not None:
        raise ValueError("read_only=True writes nothing, and a fast tier (local=) saves: drop one of them")
    if not 0 <= stage_delay <= 1:
        raise ValueError(f"stage_delay must be in [0, 1] seconds, got {stage_delay!r}")


def check_savers(who: Savers, local: LocalTier | None) -> None:
    """A fast tier needs every rank of the group."""
    if local is not None and who.subset:
        raise ValueError(f"a fast tier (local=) needs every rank of the group, and ranks={list(who.named)!r} "
                         f"leaves some out: drop local= or ranks=")


def check_shared(url: str, storage: Storage, world_size: int) -> None:
    """Several ranks need a store they all see."""
    if world_size > 1 and storage.fs.protocol in ("memory", ("memory",)):
        raise ValueError(
            f"{url!r}: memory:// lives inside one process; a {world_size}-rank job needs a shared "
            f"folder (file://) or an object store (s3://)"
        )
