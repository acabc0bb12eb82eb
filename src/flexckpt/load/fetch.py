"""The fetch loop of a load: the requests of a read plan (:func:`flexckpt.load.read_plan.requests_of`)
turned into bytes placed in the targets, every chunk verified against its checksum first.

The steps, each a name of its own:

- :func:`target_views`: where the bytes land, a writable view of each target (or of a CPU
  staging copy, copied home by ``PendingLoad.apply``);
- the seam, :class:`ByteSource`: what *obtains* a request's stored bytes:
  :class:`StoreSource`, a ranged read of the step's file on the storage (or on a fast
  tier's recovery view), or the bytes of a batch a peer read once
  (:class:`flexckpt.load.exchange.BufferSource`); :meth:`FetchLoop.source_for` picks the
  source of each request. Whatever the source, the loop verifies every chunk it places;
- :class:`FetchLoop`: per request, obtain its bytes, verify its chunks, place them
  (straight into the targets when uncompressed; decompressed through a scratch buffer
  otherwise); :func:`run_shares` spreads the requests over the storage's helper threads.
"""
from __future__ import annotations

import os
import threading
from typing import Callable, Protocol

import numpy as np
import torch

from flexckpt.errors import ChecksumError
from flexckpt.format.checksum import checksum, digest, digest_parts
from flexckpt.format.codec import decompress_into
from flexckpt.format.manifest import CODECS
from flexckpt.load.read_plan import Request, Scatter
from flexckpt.storage import RangeReader, Storage
from flexckpt.storage_stall import bounded_all

def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable, without a copy. A dtype numpy has
    takes one conversion (half the time of torch's reshape and view: a load makes one a
    target); bfloat16 and the float8 types go through a uint8 view."""
    if t.requires_grad:
        t = t.detach()
    if t.dtype in _NUMPY_DTYPES and t.numel():
        return memoryview(t.numpy()).cast("B")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


_NUMPY_DTYPES = frozenset((torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16,
                           torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128))


def target_views(tensors: list[torch.Tensor]) -> tuple[list[memoryview], list[tuple[torch.Tensor, torch.Tensor]]]:
    """Where each target's bytes land: the tensor itself (contiguous, on the CPU) or a CPU
    staging copy (pinned for a CUDA tensor). Returns the views, one a target, and the
    ``(target, staging copy)`` pairs to copy home once every rank has read."""
    views: list[memoryview] = []
    copy_back: list[tuple[torch.Tensor, torch.Tensor]] = []
    for t in tensors:
        if t.is_cpu and t.is_contiguous():  # is_cpu: a third of device.type's cost (a load has hundreds)
            views.append(byte_view(t))
        else:
            tmp = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.device.type == "cuda")
            views.append(byte_view(tmp))
            copy_back.append((t, tmp))
    return views, copy_back


def verify(data: memoryview, want: str, where: str) -> None:
    """``data`` against the checksum ``want`` (16 hex digits) the manifest holds for it."""
    got = checksum(data)
    if got != want:
        raise ChecksumError(f"{where}: checksum {got} does not match the manifest's {want}; the file is damaged")


class ByteSource(Protocol):
    """The seam: what obtains the stored bytes of a request. ``offset`` and the lengths are
    stored bytes of ``file`` (a data file of the step); the bytes obtained are untrusted
    (the loop verifies every chunk). ``local(file)``: reads of it are cheap enough that the
    loop reads a group of chunks, then verifies them while they are in the CPU's cache."""

    def local(self, file: str) -> bool: ...

    def read_into(self, file: str, offset: int, out: memoryview) -> None: ...

    def read_scatter(self, file: str, offset: int, outs: list[memoryview]) -> None: ...


class StoreSource:
    """Obtains stored bytes by ranged reads of the step's files on ``storage`` (one reader a
    file, opened on first use, closed by :meth:`close`). Counts what it read:
    ``bytes_from_store``, and ``bytes_from_peers`` for the files a fast tier's recovery
    view routes to ranges a peer sent (``Storage.from_peer``). Each read's size is appended
    to its side's tally (a list's append is atomic: a read of a group of chunks takes no
    lock) and the counts are their sums."""

    def __init__(self, storage: Storage, folder: str) -> None:
        self.storage = storage
        self.folder = folder
        self._store_reads: list[int] = []
        self._peer_reads: list[int] = []
        self._readers: dict[str, tuple[RangeReader, list[int]]] = {}  # a file's reader and its side's tally
        self._lock = threading.Lock()

    @property
    def bytes_from_store(self) -> int:
        return sum(self._store_reads)

    @property
    def bytes_from_peers(self) -> int:
        return sum(self._peer_reads)

    def _reader(self, file: str) -> tuple[RangeReader, list[int]]:
        got = self._readers.get(file)  # once open, found without the lock (a dict's get is atomic)
        if got is None:
            with self._lock:
                got = self._readers.get(file)
                if got is None:
                    rel = f"{self.folder}/{file}"
                    tally = self._peer_reads if self.storage.from_peer(rel) else self._store_reads
                    got = self._readers[file] = (self.storage.open_reader(rel), tally)
        return got

    def local(self, file: str) -> bool:
        # decided per file: the fast tier's view routes a missing part to the store
        return bool(getattr(self._reader(file)[0], "local", False))

    def read_into(self, file: str, offset: int, out: memoryview) -> None:
        rd, tally = self._reader(file)
        rd.read_into(offset, out)
        tally.append(out.nbytes)

    def read_scatter(self, file: str, offset: int, outs: list[memoryview]) -> None:
        rd, tally = self._reader(file)
        tally.append(rd.read_scatter(offset, outs))  # the bytes it read

    def close(self) -> None:
        with self._lock:
            readers, self._readers = list(self._readers.values()), {}
        for rd, _tally in readers:
            rd.close()


class _Scratch(threading.local):
    """A per-thread buffer, grown as needed: a compressed request's stored bytes, or the
    bytes of an uncompressed one that no target wants (read only to be checksummed)."""

    buf: memoryview | None = None

    def take(self, n: int) -> memoryview:
        if self.buf is None or self.buf.nbytes < n:
            self.buf = memoryview(np.empty(max(n, 1), dtype=np.uint8))
        return self.buf[:n]


def verify_scattered(sc: Scatter, first: int, stop: int, bufs: list[memoryview], where: Callable[[], str]) -> None:
    """Touched chunks ``[first, stop)`` of a file against their checksums, over the places
    their bytes went (``bufs``: the targets, then the request's sink); ``where()`` names the
    bytes in the error (built only then: a load verifies hundreds of groups)."""
    if sc.multi_before[stop] == sc.multi_before[first]:  # each chunk in one place of one target
        got = [digest(bufs[d][p : p + n]) for d, p, n in
               zip(sc.first_dest[first:stop], sc.first_pos[first:stop], sc.first_len[first:stop])]
    else:
        got = []
        for k in range(first, stop):
            if sc.multi[k]:
                a, b = sc.seg_first[k], sc.seg_first[k + 1]
                got.append(digest_parts([bufs[d][p : p + n] for d, p, n in
                                         zip(sc.seg_dest[a:b], sc.seg_pos[a:b], sc.seg_len[a:b])]))
            else:
                d, p, n = sc.first_dest[k], sc.first_pos[k], sc.first_len[k]
                got.append(digest(bufs[d][p : p + n]))
    want = sc.checks[first:stop]
    if got != want:
        k = next(k for k in range(len(got)) if got[k] != want[k])
        raise ChecksumError(
            f"{where()}: chunk at byte {sc.offsets[first + k]} has checksum {got[k]:016x}, the manifest says "
            f"{want[k]:016x}; the file is damaged"
        )


class FetchLoop:
    """Fetches requests into ``views`` (one a target, as :func:`target_views` gives them):
    :meth:`fetch` one request, from the source :meth:`source_for` picks; ``route`` (a
    request to its source; default: always ``store``) is where a later change obtains some
    requests' bytes elsewhere. Safe to call from several threads at once."""

    def __init__(self, views: list[memoryview], store: StoreSource, folder: str,
                 route: Callable[[Request], ByteSource] | None = None) -> None:
        self.views = views
        self.store = store
        self.folder = folder
        self.route = route
        self._scratch = _Scratch()

    def source_for(self, r: Request) -> ByteSource:
        """The seam: what obtains request ``r``'s stored bytes."""
        return self.store if self.route is None else self.route(r)

    def where(self, r: Request) -> str:
        return f"{self.folder}/{r.plan.file} bytes [{r.offset}, {r.offset + r.length})"

    def fetch(self, r: Request, source: ByteSource | None = None) -> int:
        """Obtain, verify and place request ``r`` (its bytes from ``source``, else from the
        one :meth:`source_for` picks); returns how many of its chunks landed wholly in
        targets (none when compressed: those go through a scratch buffer)."""
        source = source or self.source_for(r)
        return self._compressed(r, source) if r.compressed else self._scattered(r, source)

    def _compressed(self, r: Request, source: ByteSource) -> int:
        """The request read whole into scratch; each chunk verified, decompressed and its
        copies made into the targets."""
        at = self.where(r)
        mv = self._scratch.take(r.length)
        source.read_into(r.plan.file, r.offset, mv)
        p, e = r.plan, r.plan.entry
        ids = p.ids[r.first : r.stop]
        a = int(p.copy_first[r.first])
        copies = [col[a : p.copy_first[r.stop]].tolist()
                  for col in (p.copy_chunk_pos, p.copy_nbytes, p.copy_dest, p.copy_dest_pos)]
        ends = (p.copy_first[r.first + 1 : r.stop + 1] - a).tolist()  # each chunk's copies end there
        views, begin = self.views, 0
        for off, n, check, codec, raw_n, end in zip(e.offsets[ids].tolist(), e.lengths[ids].tolist(),
                                                    e.checksums[ids].tolist(), e.codec_ids[ids].tolist(),
                                                    e.raw_lengths[ids].tolist(), ends):
            stored = mv[off - r.offset : off - r.offset + n]
            verify(stored, f"{check:016x}", at)
            raw = memoryview(decompress_into(CODECS[codec], stored, raw_n, at))
            for cp, nb, t, tp in zip(*(col[begin:end] for col in copies)):
                views[t][tp : tp + nb] = raw[cp : cp + nb]
            begin = end
        return 0

    def _scattered(self, r: Request, source: ByteSource) -> int:
        """Uncompressed: each chunk's bytes read straight into the targets that want them
        (the rest into the sink, still needed for the checksum), then each chunk verified
        over the places its bytes went."""
        sc = r.scatter
        assert sc is not None
        bufs = [*self.views, self._scratch.take(r.sink_bytes)] if r.sink_bytes else self.views  # SINK (-1): the last
        x, y = r.place_start, r.groups[-1][1]
        places = [bufs[d][p : p + n] for d, p, n in zip(sc.place_dest[x:y], sc.place_pos[x:y], sc.place_len[x:y])]
        file = r.plan.file
        where = lambda: self.where(r)  # noqa: E731 - named only in an error
        if not source.local(file):  # a store's file: a read is a request, one a fetch
            source.read_scatter(file, r.offset, places)
            verify_scattered(sc, r.first, r.stop, bufs, where)
        else:
            # a local file: read a group of chunks, then verify them while their bytes are
            # still in the CPU's cache (hashing after the whole request is read would fetch
            # every byte from memory a second time)
            read, offsets = source.read_scatter, sc.offsets
            first, begin = r.first, 0
            for end, place_end in r.groups:
                stop = place_end - x
                read(file, offsets[first], places[begin:stop])
                verify_scattered(sc, first, end, bufs, where)
                first, begin = end, stop
        return (r.stop - r.first) - (sc.sunk_before[r.stop] - sc.sunk_before[r.first])


def read_threads_for(local: bool, cpus: int | None = None, local_ranks: int | None = None) -> int:
    """The default number of a load's reading threads: 2, but 1 from a local filesystem when
    the node has fewer than 2 CPUs (``cpus``: this process's, by default) per local rank
    (``local_ranks``: ``LOCAL_WORLD_SIZE``, as torchrun sets it; 1 when unset). A store's
    reads wait on the network, so they take 2 whatever the cores; a local file's read is a
    copy from the page cache and a checksum, CPU work that more threads than cores only
    slows (bench/RESULTS.md: 2 -> 2 warm at 400 MiB, 1.19x the limit with 1 against 1.44x with 2
    on 2 cores)."""
    if not local:
        return 2
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if local_ranks is None:
        try:
            local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        except ValueError:
            local_ranks = 1
    return 2 if cpus // local_ranks >= 2 else 1


def run_shares(fetch: Callable[[Request], int], requests: list[Request], threads: int, stall: float | None,
               what: str) -> list[int]:
    """``fetch`` of every request, in file order, on up to ``threads`` of the storage calls'
    helper threads (reused from load to load), under one stall watch each, not one per
    read (a resharding load makes hundreds). Each share takes the next request once done
    with one (requests differ in size: a fixed split left one thread with most of the
    bytes); a failed fetch stops them all from taking more. Returns ``fetch``'s results."""
    if not requests:
        return []
    todo = requests[::-1]  # taken from the end: in file order (list.pop and clear are atomic)

    def share() -> list[int]:
        done = []
        while True:
            try:
                r = todo.pop()
            except IndexError:
                return done
            try:
                done.append(fetch(r))
            except BaseException:
                todo.clear()
                raise

    try:
        shares = bounded_all(stall, what, [share] * max(1, min(threads, len(requests))))
    finally:
        todo.clear()  # a call given up (stalled) takes no more
    return [n for part in shares for n in part]
