"""Moving a saved rank's files between nodes over the tier's own gloo group.

gloo pairs send and receive by order, and a receive that times out closes the pair for
good, so a receiver never waits idle inside gloo: the sender first rings a doorbell in the
process group's key-value store (``src->dst/seq`` = the header), and the receiver, which
polls that key, posts its receive only once a transfer is known to be on its way. A copy
is a header (magic, step, attempt number, source rank, length, xxh3 of the marker,
sequence, the marker's length), the marker, then each file named in it, one message each,
sent straight from where the sender holds it (no packed copy). The receiver checks the
header and the marker's xxh3; the files are checked by whoever knows their format (the
fast tier: table and values against the marker, each data chunk against the table), so
every byte is hashed once on each side. Only CPU tensors, only ``send``/``recv`` on the
tier's group."""
from __future__ import annotations

import logging
import mmap
import threading
import time
import warnings
from typing import Callable, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from flexckpt.format.checksum import checksum_int
from flexckpt.p2p import as_tensor, wait

log = logging.getLogger("flexckpt")

MAGIC = 0x46585449455232  # "FXTIER2"


class Header(NamedTuple):
    step: int
    attempt: int
    source: int
    length: int  # the marker and the files, in all
    checksum: int  # xxh3 of the marker
    seq: int
    meta: int  # the marker's length

    def tensor(self) -> torch.Tensor:
        check = self.checksum - (1 << 64) if self.checksum >= 1 << 63 else self.checksum
        return torch.tensor([MAGIC, self.step, self.attempt, self.source, self.length, check, self.seq, self.meta],
                            dtype=torch.int64)

    @staticmethod
    def from_tensor(t: torch.Tensor) -> "Header":
        v = [int(x) for x in t.tolist()]
        if v[0] != MAGIC:
            raise ValueError(f"transfer header has magic {v[0]:#x}, expected {MAGIC:#x}")
        return Header(v[1], v[2], v[3], v[4], v[5] & ((1 << 64) - 1), v[6], v[7])

    def key(self, dst: int, prefix: str) -> str:
        return f"{prefix}/{self.source}-{dst}/{self.seq}"


digest = checksum_int  # xxh3-64 of a transfer's bytes, in one call (the GIL let go while it hashes)


def mapped(path: str, offset: int, length: int) -> np.ndarray:
    """Bytes ``[offset, offset + length)`` of a tier file, mapped (read-only, pages mapped
    at once), not copied: gloo sends from the page cache."""
    if not length:
        return np.empty(0, dtype=np.uint8)
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), offset + length - start, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                      prot=mmap.PROT_READ, offset=start)
    return np.frombuffer(m, dtype=np.uint8, count=length, offset=offset - start)


def send(group: "dist.ProcessGroup", store: "dist.Store", prefix: str, dst: int, header: Header,
         meta: bytes, files: "list[bytes | memoryview | np.ndarray]", timeout: float) -> None:
    """Ring ``dst``'s doorbell, then send the header, the marker ``meta`` and each non-empty
    file of ``files`` (``dst`` a global rank; ``header.length`` and ``header.meta`` count
    them, ``header.checksum`` is ``digest(meta)``)."""
    store.set(header.key(dst, prefix), b"1")
    wait(dist.isend(header.tensor(), dst, group=group), timeout)
    for part in [meta, *files]:
        if memoryview(part).nbytes:
            wait(dist.isend(as_tensor(part), dst, group=group), timeout)


def recv(group: "dist.ProcessGroup", src: int, timeout: float) -> tuple[Header, bytes]:
    """Receive a copy's header and marker from ``src`` (a transfer already announced),
    checked against each other; the files follow (:class:`Files`)."""
    h = torch.zeros(8, dtype=torch.int64)
    wait(dist.irecv(h, src, group=group), timeout)
    header = Header.from_tensor(h)
    if not 0 < header.meta <= header.length:
        raise ValueError(f"transfer from rank {src}: a {header.meta}-byte marker in {header.length} bytes")
    meta = np.empty(header.meta, dtype=np.uint8)
    wait(dist.irecv(torch.from_numpy(meta), src, group=group), timeout)
    if digest(meta) != header.checksum:
        raise ValueError(f"transfer of step {header.step} from rank {src}: the marker's checksum does not match")
    return header, meta.tobytes()


class Files:
    """Receives the files that follow one copy's marker, into ``buffer`` (reused from copy
    to copy: no fresh pages a copy) or a larger one. ``receive(lengths)`` is called once,
    with the lengths the marker names, in order."""

    def __init__(self, group: "dist.ProcessGroup", src: int, header: Header, timeout: float, buffer: np.ndarray) -> None:
        self.group, self.src, self.header, self.timeout = group, src, header, timeout
        self.buffer = buffer
        self.done = False

    def receive(self, lengths: list[int]) -> list[np.ndarray]:
        total = sum(lengths)
        if total + self.header.meta != self.header.length:
            raise ValueError(f"transfer of step {self.header.step} from rank {self.src}: its marker names {total} bytes "
                             f"of files, its header {self.header.length - self.header.meta}")
        if self.buffer.nbytes < total:
            self.buffer = np.empty(total, dtype=np.uint8)
        out, pos = [], 0
        for n in lengths:
            part = self.buffer[pos : pos + n]
            if n:
                wait(dist.irecv(torch.from_numpy(part), self.src, group=self.group), self.timeout)
            out.append(part)
            pos += n
        self.done = True
        return out


class Inbox(threading.Thread):
    """Receives, in order, the copies one source rank sends to this rank, and hands each
    (its header, its checked marker, and a :class:`Files` to receive its files with) to
    ``deliver``. Stops at ``stop``; a broken transfer (the source died, or a copy whose
    files were not all received) ends it too: the pair is out of step for good."""

    def __init__(self, group: "dist.ProcessGroup", store: "dist.Store", prefix: str, src: int, me: int,
                 timeout: float, deliver: Callable[[Header, bytes, Files], None], name: str) -> None:
        super().__init__(name=name, daemon=True)
        self.group, self.store, self.prefix, self.src, self.me = group, store, prefix, src, me
        self.timeout, self.deliver = timeout, deliver
        self.stop = threading.Event()
        self.received = 0
        self.failures = 0
        self._buffer = np.empty(0, dtype=np.uint8)

    def run(self) -> None:
        seq = 0
        while not self.stop.is_set():
            key = f"{self.prefix}/{self.src}-{self.me}/{seq}"
            try:
                rung = self.store.check([key])
            except Exception:  # noqa: BLE001 - the store went away: the job is ending
                return
            if not rung:
                self.stop.wait(0.02)
                continue
            try:
                header, meta = recv(self.group, self.src, self.timeout)
                if header.seq != seq or header.source != self.src:
                    raise ValueError(f"expected transfer {seq} from rank {self.src}, got {header.seq} from {header.source}")
            except Exception:  # noqa: BLE001 - the pair is broken for good: this source's copies stop here
                self.failures += 1
                log.exception("flexckpt fast tier: receiving copy %d from rank %d failed", seq, self.src)
                return
            seq += 1
            try:
                self.store.delete_key(key)
            except Exception:  # noqa: BLE001 - a store without deletes keeps a few bytes a copy
                pass
            files = Files(self.group, self.src, header, self.timeout, self._buffer)
            try:
                self.deliver(header, meta, files)
                self.received += 1
            except Exception:  # noqa: BLE001 - this copy is lost (never marked complete); the next may land
                self.failures += 1
                log.exception("flexckpt fast tier: storing the copy of step %d from rank %d failed", header.step, self.src)
                if not files.done:  # its files were not received: the messages that follow are out of step
                    return
            self._buffer = files.buffer


# -- recovery: byte ranges a recovering rank asked of a peer ----------------------------------
FETCH_MAGIC = 0x46585246455431  # "FXRFET1"


def _fetch_header(step: int, saved: int, count: int, nbytes: int, ok: bool) -> torch.Tensor:
    return torch.tensor([FETCH_MAGIC, step, saved, count, nbytes, int(ok)], dtype=torch.int64)


def announce(group: "dist.ProcessGroup", dst: int, step: int, saved: int, lengths: "list[int] | None") -> "dist.Work":
    """Send ``dst`` (a global rank) the header of a transfer of ranges of ``lengths`` bytes,
    which ``send_range`` then sends one message each. ``lengths`` None: the files could not
    be read here; the header says so and nothing follows. No checksum travels: the load
    verifies every chunk against its table, every table against the manifest."""
    ok = lengths is not None
    return dist.isend(_fetch_header(step, saved, len(lengths or ()), sum(lengths or ()), ok), dst, group=group)


def send_range(group: "dist.ProcessGroup", dst: int, payload: np.ndarray) -> "dist.Work":
    """One announced range (the caller keeps ``payload`` alive until the work finishes)."""
    with warnings.catch_warnings():  # a read-only mapping of a tier file: sent, never written
        warnings.simplefilter("ignore", UserWarning)
        return dist.isend(torch.from_numpy(payload), dst, group=group)


class Incoming:
    """The ranges one transfer brings: the header is awaited at once (a server that could
    not read its files sends no payload, and a receive never waits for what will not come);
    then one receive per range is posted, into ``into[i]`` where given (a stretch of the
    target tensor the range lands in whole), else into a buffer of its own. ``ready(i)``
    waits for range ``i``."""

    def __init__(self, group: "dist.ProcessGroup", src: int, step: int, saved: int, lengths: list[int],
                 timeout: float, into: "list[np.ndarray | None] | None" = None) -> None:
        self.src, self.timeout = src, timeout
        h = torch.zeros(6, dtype=torch.int64)
        wait(dist.irecv(h, src, group=group), timeout)
        magic, got_step, got_saved, count, nbytes, ok = (int(x) for x in h.tolist())
        if magic != FETCH_MAGIC:
            raise ValueError(f"fetch header from rank {src} has magic {magic:#x}, expected {FETCH_MAGIC:#x}")
        if not ok:
            raise ValueError(f"rank {src} could not read the files of saved rank {saved} of step {step} it holds")
        if (got_step, got_saved, count, nbytes) != (step, saved, len(lengths), sum(lengths)):
            raise ValueError(f"rank {src} sends step {got_step}, saved rank {got_saved}, {count} ranges, {nbytes} bytes; "
                             f"expected step {step}, saved rank {saved}, {len(lengths)} ranges, {sum(lengths)} bytes")
        self.buffers = [b if b is not None else np.empty(n, dtype=np.uint8) for n, b in zip(lengths, into or [None] * len(lengths))]
        self._works = [dist.irecv(torch.from_numpy(b), src, group=group) for b in self.buffers]
        self._done = [False] * len(lengths)
        self._lock = threading.Lock()
        self.waited = 0.0  # seconds the load waited for these ranges

    def ready(self, i: int) -> None:
        with self._lock:
            if not self._done[i]:
                t0 = time.perf_counter()
                wait(self._works[i], self.timeout)
                self._done[i] = True
                self.waited += time.perf_counter() - t0

    def wait_all(self) -> None:
        for i in range(len(self._works)):
            self.ready(i)
