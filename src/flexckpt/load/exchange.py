"""Read once, fan out: the exchange of a load's shared chunks over its process group
(the plan is :mod:`flexckpt.load.fanout`'s).

1. :func:`gather_needs`: every rank's needed chunks (file, id, stored offset and length),
   one all-gather of counts and one of the rows (int64 tensors: nothing is pickled). A
   rank that failed before it knew its chunks joins with a count of -1, and every rank
   stops there, naming it.
2. :class:`Exchange`: per rank, a *sender* thread reads the batches it is the reader of
   from the store (``reads_ahead`` at once, in order), sends each to its receivers
   (point-to-point on the load's group, gloo on the CPU: a header, then the stored bytes)
   and places its own copy through the fetch loop; what it has read and not yet seen
   taken stays within :data:`HELD_BYTES` (a batch is at most :data:`BATCH_BYTES`, or one
   chunk). A batch whose bytes land unchanged in one stretch of one target is read, sent
   and received straight there (:func:`landing`). One *receiver* thread per reader takes that reader's
   batches in plan order (gloo matches a pair's messages by order) and places each through
   the fetch loop, which verifies every chunk against the manifest's checksum; where the
   check fails, the chunks whose bytes are wrong are read from the store (counted in
   ``LoadStats.peer_chunks_reread``) and the batch placed again, and only a second failure
   fails the load. The rank's own chunks are read meanwhile by the load's usual threads.
3. Failure: a reader whose read or own check fails sends a *failed* header to every rank
   still waiting on it, which then fails naming the reader; a reader that died or hangs
   fails each rank waiting on it after ``timeout`` seconds without its next message
   (:class:`PeerFailure`, naming it). The load's agreement then names the reader on every
   rank (:func:`flexckpt.agree.first_failed_rank` ranks a peer's failure after its cause).

The chunks travel over a :class:`HostWire` (CPU tensors as they are, a gloo group) or, with
``Checkpointer(fanout="nccl")``, a :class:`DeviceWire` (an NCCL group: each message copied
host->device before its send and received into a device buffer, then copied to the host,
where its chunks are checked and placed as over gloo). One exchange, either wire (DESIGN:
"Read once, fan out").
"""
from __future__ import annotations

import collections
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from flexckpt.agree import distributed
from flexckpt.format.checksum import digest
from flexckpt.errors import ChecksumError, LoadError
from flexckpt.load.fanout import Batch, FanoutPlan, plan_fanout, wanted
from flexckpt.load.fetch import FetchLoop, StoreSource, run_shares
from flexckpt.load.read_plan import FilePlan, Request, requests_of
from flexckpt.p2p import as_tensor, wait
from flexckpt.storage import Storage

PEER_TIMEOUT = 60.0  # seconds a rank waits for a peer's next message (a batch, or its failed header)
BATCH_BYTES = 4 << 20  # a batch (one message, one store request) is at most this many bytes (one chunk may be more)
HELD_BYTES = 64 << 20  # a reader holds at most this many bytes read or being read and not yet taken
MAGIC = 0x46584641_4E4F5554 >> 8  # "FXFANOU"


class PeerFailure(LoadError):
    """This rank's load failed because a peer's did (a reader that failed or died)."""

    def __init__(self, message: str, peer: int) -> None:
        super().__init__(message)
        self.peer = peer


class HostWire:
    """Messages travel as the CPU tensors they are (a gloo group)."""

    def out(self, t: torch.Tensor) -> torch.Tensor:
        """What is sent for host tensor ``t`` (kept alive until its send completes)."""
        return t

    def into(self, t: torch.Tensor) -> torch.Tensor:
        """What is received into, for host tensor ``t``."""
        return t

    def landed(self, got: torch.Tensor, t: torch.Tensor) -> None:
        """After the receive into ``got`` completed: ``t`` holds its bytes."""


class DeviceWire(HostWire):
    """Messages travel as tensors on ``device`` (an NCCL group's): each sent one copied
    host->device, each received one received into a buffer there and copied to the host
    (where its chunks are checked and placed). A message's device copy lives as long as
    its host bytes are held: the exchange's bounds hold on the device too."""

    def __init__(self, device: "torch.device | str") -> None:
        self.device = torch.device(device)

    def out(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device, copy=True)

    def into(self, t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=t.dtype, device=self.device)

    def landed(self, got: torch.Tensor, t: torch.Tensor) -> None:
        t.copy_(got)  # blocking: ordered after the receive (its wait), done before the bytes are checked


class Fanout:
    """A load's fan-out settings, decided alike on every rank (:func:`flexckpt.load.fanout.wanted`):
    the load's group, this rank and the world, the seconds a rank waits for a peer's next
    message and the wire the messages travel on. ``joined``: this rank took part in
    :func:`gather_needs` (a rank that failed before calls :meth:`join_failed`, so that no
    rank waits in the gather)."""

    def __init__(self, rank: int, world: int, group: "dist.ProcessGroup | None", timeout: float | None = None,
                 wire: HostWire | None = None) -> None:
        self.rank, self.world, self.group = rank, world, group
        self.wire = HostWire() if wire is None else wire
        self.timeout = PEER_TIMEOUT if timeout is None else timeout
        self.joined = False

    def to_global(self, r: int) -> int:
        return r if self.group is None else dist.get_global_rank(self.group, r)

    def join_failed(self) -> None:
        if not self.joined:
            try:
                gather_needs(self, None)
            except PeerFailure:
                pass


def fanout_for(mode: "str | bool", storage: "Storage", rank: int, world: int,
               group: "dist.ProcessGroup | None") -> Fanout | None:
    """A load's fan-out (:func:`flexckpt.load.fanout.wanted`, decided alike on every rank), or None;
    ``mode="nccl"``: over a :class:`DeviceWire` on this rank's current CUDA device."""
    if not distributed(world):
        return None
    if not wanted(mode, world, storage.local, storage.url, dist.get_backend(group)):
        return None
    wire = DeviceWire(torch.device("cuda", torch.cuda.current_device())) if mode == "nccl" else HostWire()
    return Fanout(rank, world, group, wire=wire)


def gather_needs(fan: Fanout, rows: np.ndarray | None) -> list[np.ndarray]:
    """Every rank's needed chunks, from ``rows`` (this rank's: one a chunk, file index,
    chunk id, stored offset, stored length; None: this rank failed before it knew them):
    one all-gather of the counts, one of the rows, int64 tensors (nothing is pickled).
    Every rank of the group calls it once a load."""
    fan.joined = True
    n = torch.tensor([-1 if rows is None else len(rows)], dtype=torch.int64)
    counts = [torch.zeros(1, dtype=torch.int64) for _ in range(fan.world)]
    _all_gather(fan, counts, n)
    sizes = [int(c.item()) for c in counts]
    if -1 in sizes:
        failed = sizes.index(-1)
        raise PeerFailure(f"rank {failed} failed before the fan-out of the load's reads (see its error)", failed)
    most = max(sizes)
    if not most:
        return [np.zeros((0, 4), dtype=np.int64) for _ in sizes]
    mine = torch.zeros((most, 4), dtype=torch.int64)
    mine[: len(rows)] = torch.from_numpy(rows)  # type: ignore[arg-type]
    out = [torch.zeros((most, 4), dtype=torch.int64) for _ in range(fan.world)]
    _all_gather(fan, out, mine)
    return [o[:s].numpy() for o, s in zip(out, sizes)]


def _all_gather(fan: Fanout, out: list[torch.Tensor], mine: torch.Tensor) -> None:
    got = [fan.wire.into(o) for o in out]
    dist.all_gather(got, fan.wire.out(mine), group=fan.group)
    for g, o in zip(got, out):
        fan.wire.landed(g, o)


def _by_file(everyone: list[np.ndarray], names: list[str]
             ) -> tuple[list[dict[str, np.ndarray]], dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The gathered rows as :func:`flexckpt.load.fanout.plan_fanout` takes them: each rank's
    chunk ids by file, and each file's chunks' stored offsets and lengths (by chunk id;
    those no rank needs left 0)."""
    needs: list[dict[str, np.ndarray]] = []
    offsets: dict[str, np.ndarray] = {}
    lengths: dict[str, np.ndarray] = {}
    for got in everyone:
        mine: dict[str, np.ndarray] = {}
        got = got[np.lexsort((got[:, 1], got[:, 0]))]
        cuts = np.flatnonzero(np.diff(got[:, 0])) + 1
        for part in np.split(got, cuts) if len(got) else []:
            name = names[int(part[0, 0])]
            mine[name] = part[:, 1]
            top = int(part[:, 1].max()) + 1
            for cols, k in ((offsets, 2), (lengths, 3)):
                have = cols.get(name)
                if have is None or len(have) < top:
                    grown = np.zeros(top, dtype=np.int64)
                    if have is not None:
                        grown[: len(have)] = have
                    cols[name] = have = grown
                have[part[:, 1]] = part[:, k]
        needs.append(mine)
    return needs, offsets, lengths


def fetch_fanned(fan: Fanout, names: list[str], plans: list[FilePlan], loop: "FetchLoop", store: "StoreSource",
                 fetch_bytes: int, group_bytes: int, threads: int, stall: float | None, url: str
                 ) -> tuple[list[Request], list[int], "Exchange"]:
    """A rank's fetch with fan-out: learn every rank's chunks (``plans``: this rank's
    file plans; ``names``: the manifest's data files, in one order on every rank), plan
    the fan-out, cut this rank's requests at its batches, then run the exchange beside the
    fetch of this rank's own chunks. Returns the requests, each fetch's whole chunks (the
    exchange's in ``Exchange.direct``) and the exchange."""
    index = {name: i for i, name in enumerate(names)}
    rows = np.concatenate([np.stack([np.full(len(p.ids), index[p.file]), p.ids, p.entry.offsets[p.ids],
                                     p.entry.lengths[p.ids]], axis=1) for p in plans]).astype(np.int64) \
        if plans else np.zeros((0, 4), dtype=np.int64)
    needs, offsets, lengths = _by_file(gather_needs(fan, rows), names)
    plan = plan_fanout(needs, offsets, lengths, min(fetch_bytes, BATCH_BYTES))
    labels = plan.labels(fan.rank, {p.file: p.ids for p in plans})
    requests = requests_of(plans, fetch_bytes, group_bytes, labels)
    own: list[Request] = []
    batch_of: dict[int, Request] = {}
    for r in requests:
        k = int(labels[r.plan.file][r.first])
        if k < 0:
            own.append(r)
            continue
        b = plan.batches[k]
        if (r.offset, r.length) != (b.offset, b.length):  # the plan and the cut disagree: a bug, not the data's
            raise LoadError(f"fan-out batch {k} ({b.file} bytes [{b.offset}, {b.offset + b.length})) is request "
                            f"[{r.offset}, {r.offset + r.length}) on rank {fan.rank}")
        batch_of[k] = r

    def checks(k: int) -> tuple[list[int], list[int], list[int]]:
        b, e = plan.batches[k], batch_of[k].plan.entry
        return (e.offsets[b.first : b.stop].tolist(), e.lengths[b.first : b.stop].tolist(),
                e.checksums[b.first : b.stop].tolist())

    exchange = Exchange(plan, fan.rank, fan.group, fan.to_global, batch_of, loop.fetch,
                        lambda r: landing(r, loop.views), store.read_into, checks, fan.timeout, threads, fan.wire)
    exchange.start()
    error: BaseException | None = None
    whole: list[int] = []
    try:
        whole = run_shares(loop.fetch, own, threads, stall, f"reading {len(own)} ranges on {url}")
    except BaseException as exc:  # noqa: BLE001 - the exchange's threads finish first (peers wait on them)
        error = exc
    try:
        exchange.finish()
    except BaseException:
        if error is None:
            raise
    if error is not None:
        raise error
    return requests, whole, exchange


def _header(k: int, ok: bool, length: int) -> torch.Tensor:
    return torch.tensor([MAGIC, k, int(ok), length], dtype=torch.int64)


class BufferSource:
    """The stored bytes of one batch, held in ``buf`` (stored offset ``offset`` of its
    file): a fetch loop's byte source for the batch's request."""

    def __init__(self, buf: np.ndarray, offset: int) -> None:
        self.buf, self.offset = buf, offset

    def local(self, file: str) -> bool:
        return False

    def read_into(self, file: str, offset: int, out: memoryview) -> None:
        a = offset - self.offset
        out[:] = memoryview(self.buf[a : a + out.nbytes])

    def read_scatter(self, file: str, offset: int, outs: list[memoryview]) -> None:
        a = offset - self.offset
        for o in outs:
            n = memoryview(o).nbytes
            o[:] = memoryview(self.buf[a : a + n])
            a += n


class InPlace:
    """The stored bytes of one batch, already where they land (received or read straight
    into one stretch of one target): a byte source that moves nothing; the fetch loop
    still verifies every chunk there."""

    def local(self, file: str) -> bool:
        return False

    def read_into(self, file: str, offset: int, out: memoryview) -> None:  # never: compressed batches are copied
        raise AssertionError("a compressed batch is never placed in place")

    def read_scatter(self, file: str, offset: int, outs: list[memoryview]) -> None:
        pass


def landing(r: Request, views: list[memoryview]) -> np.ndarray | None:
    """Where request ``r``'s stored bytes land unchanged: one stretch of one target (no
    codec, no bytes for the sink, its places adjacent), as a writable array; else None."""
    if r.compressed or r.sink_bytes or r.scatter is None:
        return None
    sc, x, y = r.scatter, r.place_start, r.groups[-1][1]
    d, start = sc.place_dest[x], sc.place_pos[x]
    end = start
    for i in range(x, y):
        if sc.place_dest[i] != d or sc.place_pos[i] != end:
            return None
        end += sc.place_len[i]
    return np.frombuffer(views[d][start:end], dtype=np.uint8) if end - start == r.length else None


class Exchange:
    """One rank's part of a fanned-out load: the threads that read and send its batches
    and receive the batches others read for it, each placed by ``place(request, source)``
    (the fetch loop, through the given source). ``mine``: this rank's request of each batch
    it takes part in, by batch index. ``read(file, offset, out)``: a ranged read from the
    store (counted by the caller). ``chunk_checks(k)``: batch ``k``'s chunks' stored offsets,
    lengths and checksums. ``wire``: what the messages travel as (:class:`HostWire`: CPU tensors)."""

    def __init__(self, plan: FanoutPlan, rank: int, group: "dist.ProcessGroup | None", to_global: Callable[[int], int],
                 mine: dict[int, Request], place: Callable[[Request, "BufferSource | InPlace"], int],
                 spot: Callable[[Request], np.ndarray | None],
                 read: Callable[[str, int, memoryview], None],
                 chunk_checks: Callable[[int], tuple[list[int], list[int], list[int]]], timeout: float,
                 reads_ahead: int = 2, wire: HostWire | None = None) -> None:
        self.plan, self.rank, self.group, self.to_global = plan, rank, group, to_global
        self.wire = HostWire() if wire is None else wire
        self.mine, self.place, self.spot, self.read, self.chunk_checks = mine, place, spot, read, chunk_checks
        self.timeout = timeout
        self.reads_ahead = max(1, reads_ahead)  # a reader's batches read at once (the load's read threads)
        self.bytes_from_peers = 0
        self.rereads = 0
        self.direct = 0  # chunks that landed wholly in targets
        self._lock = threading.Lock()
        self._errors: list[tuple[str, BaseException]] = []
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        sends = self.plan.sends(self.rank)
        if sends:
            self._spawn(f"flexckpt-fanout-send-r{self.rank}", self._send_all, sends)
        for reader, batches in sorted(self.plan.receives(self.rank).items()):
            self._spawn(f"flexckpt-fanout-recv-r{self.rank}-from-r{reader}", self._receive_all, reader, batches)

    def _spawn(self, name: str, fn: Callable, *args: object) -> None:
        def run() -> None:
            try:
                fn(*args)
            except BaseException as exc:  # noqa: BLE001 - raised by finish(), on the loading thread
                with self._lock:
                    self._errors.append((name, exc))

        t = threading.Thread(target=run, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    def finish(self) -> None:
        """Wait for the threads (each bounded by ``timeout`` a message); raise the first
        error, the reader's own before a receiver's."""
        for t in self._threads:
            t.join()
        if self._errors:
            errors = sorted(self._errors, key=lambda e: isinstance(e[1], PeerFailure))
            raise errors[0][1]

    # -- the reader's side ---------------------------------------------------------------------
    def _send_all(self, sends: list[int]) -> None:
        """Read this rank's batches (``reads_ahead`` at once, in order), send each to its
        receivers and place this rank's own copy; what is read or sent and not yet taken
        stays within :data:`HELD_BYTES` (one batch more, when one alone exceeds it)."""
        held: collections.deque = collections.deque()  # (works, buffer, bytes) sent, oldest first
        reading: collections.deque = collections.deque()  # (batch, future), in order
        held_bytes, ahead = 0, 0  # bytes read, being read or sent and not yet taken; sends[:ahead] started
        told = 0  # sends[:told]'s receivers have their messages (the batch, or a failed header)
        pool = ThreadPoolExecutor(self.reads_ahead, thread_name_prefix=f"flexckpt-fanout-read-r{self.rank}")
        try:
            while told < len(sends):
                while ahead < len(sends) and len(reading) < self.reads_ahead:
                    n = self.plan.batches[sends[ahead]].length
                    if held_bytes + n > HELD_BYTES and (held or reading):
                        break
                    reading.append((sends[ahead], pool.submit(self._read_batch, sends[ahead])))
                    held_bytes += n
                    ahead += 1
                if not reading:  # at the bound: wait for the oldest sends to be taken
                    held_bytes -= self._settle(held.popleft())
                    continue
                k, future = reading.popleft()
                buf, out, source = future.result()
                b = self.plan.batches[k]
                works = []
                sent = [self.wire.out(_header(k, True, b.length)), self.wire.out(as_tensor(out))]
                for dst in b.receivers:
                    g = self.to_global(dst)
                    try:
                        works.extend((dst, dist.isend(t, g, group=self.group)) for t in sent)
                    except Exception as exc:  # noqa: BLE001 - the pair is closed: that rank died
                        raise self._not_taken(dst, exc) from None
                told += 1
                held.append((works, (out, sent), b.length))
                self._placed(self.place(self.mine[k], source))
            while held:
                self._settle(held.popleft())
        except BaseException:
            for _, future in reading:
                future.cancel()
            self._tell_failed(sends[told:])
            raise
        finally:
            pool.shutdown(wait=True)

    def _read_batch(self, k: int) -> tuple[np.ndarray, np.ndarray, "BufferSource | InPlace"]:
        """Batch ``k``'s stored bytes from the store (straight into this rank's target
        where they land unchanged), what is sent (the same, but for the tests' faults),
        and the source that places them here."""
        b = self.plan.batches[k]
        fail = _faults.get("fail")
        if fail is not None and fail(self.rank, k):
            raise OSError(f"injected: rank {self.rank} cannot read batch {k}")
        spot = self.spot(self.mine[k])
        buf = spot if spot is not None else np.empty(b.length, dtype=np.uint8)
        self.read(b.file, b.offset, memoryview(buf))
        source = InPlace() if spot is not None else BufferSource(buf, b.offset)
        corrupt = _faults.get("corrupt")
        if corrupt is not None and corrupt(self.rank, k):
            out = buf.copy()
            out[len(out) // 2] ^= 0xFF
            return buf, out, source
        return buf, buf, source

    def _settle(self, entry: tuple) -> int:
        works, _buf, n = entry
        for dst, w in works:
            try:
                wait(w, self.timeout)
            except Exception as exc:  # noqa: BLE001 - a receiver that stopped taking (failed, or died)
                raise self._not_taken(dst, exc) from None
        return n

    def _not_taken(self, dst: int, exc: BaseException) -> PeerFailure:
        return PeerFailure(f"rank {self.rank}: rank {dst} did not take the chunks this rank read for it in this load "
                           f"within {self.timeout:g} s (rank {dst} failed or died; see its error): {exc}", dst)

    def _tell_failed(self, left: list[int]) -> None:
        """Each rank still waiting on this reader gets one failed header (its next message)."""
        told: set[int] = set()
        for k in left:
            b = self.plan.batches[k]
            for dst in b.receivers:
                if dst not in told:
                    told.add(dst)
                    try:
                        wait(dist.isend(self.wire.out(_header(k, False, 0)), self.to_global(dst), group=self.group),
                             self.timeout)
                    except Exception:  # noqa: BLE001 - that rank fails on its own timeout instead
                        pass

    # -- a receiver's side ---------------------------------------------------------------------
    def _receive_all(self, reader: int, batches: list[int]) -> None:
        src = self.to_global(reader)
        buf = np.empty(max(self.plan.batches[k].length for k in batches), dtype=np.uint8)
        h = torch.zeros(4, dtype=torch.int64)
        error: BaseException | None = None  # after one, the rest are still taken (the reader waits on them)
        for k in batches:
            b = self.plan.batches[k]
            what = f"{b.file} bytes [{b.offset}, {b.offset + b.length})"
            self._recv(h, src, reader, what)
            magic, got, ok, length = (int(x) for x in h.tolist())
            if magic != MAGIC or (ok and (got, length) != (k, b.length)):
                raise PeerFailure(f"rank {self.rank}: the load's fan-out from rank {reader} is out of step "
                                  f"(batch {got} of {length} bytes where {k} of {b.length} was due)", reader)
            if not ok:
                raise PeerFailure(f"rank {reader} failed to read the chunks it reads for rank {self.rank} in this load "
                                  f"({self.plan.batches[got].file} ...; see rank {reader}'s error)", reader)
            spot = self.spot(self.mine[k])  # received straight into the target where it lands unchanged
            data = spot if spot is not None else buf[: b.length]
            self._recv(torch.from_numpy(data), src, reader, what)
            with self._lock:
                self.bytes_from_peers += b.length
            if error is None:
                try:
                    self._place_checked(k, b, data, InPlace() if spot is not None else BufferSource(data, b.offset))
                except BaseException as exc:  # noqa: BLE001 - raised once the reader's batches are taken
                    error = exc
        if error is not None:
            raise error

    def _recv(self, into: torch.Tensor, src: int, reader: int, what: str) -> None:
        got = self.wire.into(into)
        try:
            wait(dist.irecv(got, src, group=self.group), self.timeout)
        except Exception as exc:  # noqa: BLE001 - the reader died or hangs: fail naming it
            raise PeerFailure(f"rank {self.rank}: no message from rank {reader}, which reads {what} for it in this "
                              f"load, within {self.timeout:g} s (rank {reader} failed or died; see its error): {exc}",
                              reader) from None
        self.wire.landed(got, into)

    def _place_checked(self, k: int, b: Batch, data: np.ndarray, source: "BufferSource | InPlace") -> None:
        """Place batch ``k`` (received into ``data``); where a chunk fails its check, read
        the bad chunks from the store into ``data``, and place again (a second failure is
        the store's: raised)."""
        try:
            self._placed(self.place(self.mine[k], source))
            return
        except ChecksumError:
            pass
        offsets, lengths, checks = self.chunk_checks(k)
        for off, n, want in zip(offsets, lengths, checks):
            piece = data[off - b.offset : off - b.offset + n]
            if digest(memoryview(piece)) != want:
                self.read(b.file, off, memoryview(piece))
                with self._lock:
                    self.rereads += 1
        self._placed(self.place(self.mine[k], source))

    def _placed(self, whole: int) -> None:
        with self._lock:
            self.direct += whole


# tests only: "corrupt"(rank, batch) -> bool: a byte flipped in transit; "fail"(rank, batch) ->
# bool: the reader's read raises
_faults: dict[str, Callable] = {}
