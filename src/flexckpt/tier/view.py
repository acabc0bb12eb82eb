"""The files of one restored step as a recovery's load reads them: each file from the
node's tier folder, from the byte ranges a peer sends, or from the persistent store.

``StepView`` stands in for a ``Storage`` under ``PendingLoad`` and the manifest's table
files (``open_reader``, ``read_bytes``, ``size``): the ordinary load reads, verifies every
chunk against its table's checksum and every table against the manifest, whichever the
source. A ``Received`` file holds only the ranges asked of a peer; a read waits for the
range it falls in to arrive (so local reads go on while peers send), then copies it out."""
from __future__ import annotations

import bisect
from typing import Callable

import numpy as np

from flexckpt.errors import MissingFile, TooLarge
from flexckpt.storage import Storage
from flexckpt.storage_stall import progress


class Received:
    """Byte ranges of one file sent by a peer: ``add`` a buffer (filled once ``ready()``
    returns) for each range asked for; reads outside them fail."""

    local = True  # in memory as it arrives: a load reads and verifies it in groups of chunks

    def __init__(self, rel: str, size: int, where: str) -> None:
        self.rel, self.size, self.where = rel, size, where
        self._starts: list[int] = []
        self._spans: list[tuple[int, np.ndarray, Callable[[], None]]] = []

    def add(self, offset: int, buf: np.ndarray, ready: Callable[[], None]) -> None:
        i = bisect.bisect(self._starts, offset)
        self._starts.insert(i, offset)
        self._spans.insert(i, (offset, buf, ready))

    def _pieces(self, offset: int, n: int):
        """(buffer, start, stop) covering bytes [offset, offset + n), in order."""
        pos, stop = offset, offset + n
        i = bisect.bisect(self._starts, offset) - 1
        while pos < stop:
            if i < 0 or i >= len(self._spans):
                raise MissingFile(f"{self.rel} from {self.where}: bytes [{pos}, {stop}) were not asked for")
            start, buf, ready = self._spans[i]
            if not start <= pos < start + buf.nbytes:
                raise MissingFile(f"{self.rel} from {self.where}: bytes [{pos}, {stop}) were not asked for")
            ready()
            hi = min(stop, start + buf.nbytes)
            yield buf, pos - start, hi - start
            pos = hi
            i += 1

    def read_into(self, offset: int, out: memoryview) -> None:
        dst = np.frombuffer(out, dtype=np.uint8)
        at = 0
        for buf, lo, hi in self._pieces(offset, dst.nbytes):
            src, out = buf[lo:hi], dst[at : at + hi - lo]
            if _address(src) != _address(out):  # received straight into the target: already in place
                out[:] = src
            at += hi - lo
        progress()

    def read_scatter(self, offset: int, outs: list[memoryview]) -> int:
        """As ``RangeReader.read_scatter``: fills ``outs`` one after the other, returns the bytes read."""
        pos = offset
        for out in outs:
            if memoryview(out).nbytes:
                self.read_into(pos, out)
            pos += memoryview(out).nbytes
        return pos - offset

    def read_bytes(self) -> bytes:
        out = bytearray(self.size)
        if self.size:
            self.read_into(0, memoryview(out))
        return bytes(out)

    def close(self) -> None:
        pass

    def __enter__(self) -> "Received":
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class StepView:
    """A read-only ``Storage`` over one step: ``routes`` maps a file's path (relative, as
    the load names it) to the ``Storage`` holding it or to the ``Received`` ranges of it;
    any other path is read from ``default`` (the node's tier folder)."""

    def __init__(self, default: Storage, routes: dict[str, "Storage | Received"]) -> None:
        self.default = default
        self.routes = routes
        self.url = default.url
        self.local = default.local
        self.stall_timeout = None  # a peer's range waits on the tier's timeout; a store's reads on the store's own

    def _source(self, rel: str) -> "Storage | Received":
        return self.routes.get(rel, self.default)

    def from_peer(self, rel: str) -> bool:
        return isinstance(self.routes.get(rel), Received)

    def open_reader(self, rel: str):  # -> RangeReader | Received
        src = self._source(rel)
        return src if isinstance(src, Received) else src.open_reader(rel)

    def read_bytes(self, rel: str, limit: int | None = None) -> bytes:
        src = self._source(rel)
        if isinstance(src, Received):
            if limit is not None and src.size > limit:
                raise TooLarge(f"{rel} from {src.where} is {src.size} bytes, more than the {limit} allowed for it")
            return src.read_bytes()
        return src.read_bytes(rel, limit)

    def size(self, rel: str) -> int:
        src = self._source(rel)
        return src.size if isinstance(src, Received) else src.size(rel)


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]
