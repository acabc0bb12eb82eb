"""Which byte ranges a recovering rank asks of which peer (pure: no processes, no I/O).

A rank asks only for the chunks its target pieces need: the ordinary load's own requests
(:func:`flexckpt.load.read_plan.plan_requests`), so that each load read falls in one asked range.
Tier files are never compressed, so a chunk's place in its file is its place in the raw
stream, which the write plan gives: the ranges are known before any chunk table arrives
(the tables come with them, for the load to verify every chunk)."""
from __future__ import annotations

import dataclasses
import itertools
import re
from typing import Any, Iterator, NamedTuple

import numpy as np

from flexckpt.format.manifest import DataFiles, FileEntry, Manifest
from flexckpt.format.names import data_name
from flexckpt.load.pending import FETCH_BYTES
from flexckpt.load.read_plan import Request, plan_requests

_RANK = re.compile(r"/r(\d{5})\.[a-z]+$")


class Ask(NamedTuple):
    """``length`` bytes at ``offset`` of file ``rel`` (relative to the step's folder); a
    whole small file has offset 0 and its full length."""

    rel: str
    offset: int
    length: int


class Transfer(NamedTuple):
    """What ``server`` sends ``receiver`` of saved rank ``saved``'s files (ranks of this launch)."""

    server: int
    receiver: int
    saved: int
    asks: tuple[Ask, ...]

    @property
    def nbytes(self) -> int:
        return sum(a.length for a in self.asks)


def saved_rank(rel: str) -> int:
    """The saved rank a data, table or values file belongs to (``ATTEMPT/rNNNNN.data``)."""
    m = _RANK.search("/" + rel)
    if m is None:
        raise ValueError(f"{rel!r} is not a saved rank's file")
    return int(m.group(1))


class _RawFiles(DataFiles):
    """A version-2 manifest's data files as uncompressed streams cut by the write plan,
    without their chunk tables (checksums left empty: for planning only)."""

    def __init__(self, manifest: Manifest) -> None:
        files: Any = manifest.files
        self.plan = files.plan
        self.names = {data_name(manifest.attempt, r): r for r, e in enumerate(manifest.ranks) if e.stored_nbytes}
        self.cache: dict[str, FileEntry] = {}

    def __getitem__(self, name: str) -> FileEntry:
        if name not in self.cache:
            raw = self.plan.rank_plan(self.names[name])
            n = len(raw.chunks)
            bounds = np.fromiter(itertools.chain.from_iterable(raw.chunks), dtype=np.int64, count=2 * n)
            self.cache[name] = FileEntry.from_columns(name, raw.nbytes, bounds[0::2], bounds[1::2], bounds[0::2],
                                                      bounds[1::2], "none", np.zeros(n, dtype=np.uint64))
        return self.cache[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


class Range(NamedTuple):
    """A range of a file that the load reads at once. ``target >= 0``: its bytes land,
    whole and in order, at byte ``target_pos`` of target ``target`` (they can be received
    there directly)."""

    offset: int
    length: int
    target: int = -1
    target_pos: int = 0


def ranges_needed(manifest: Manifest, targets: list, files: set[str]) -> dict[str, list[Range]]:
    """For each data file in ``files`` (names as the manifest gives them), the byte ranges
    the load of ``targets`` (``(SavedTensor, part)`` pairs, as ``plan_requests`` takes)
    reads of it, when the file is stored uncompressed."""
    if manifest.codec != "none":
        raise ValueError(f"byte ranges are planned on uncompressed files; this step's codec is {manifest.codec!r}")
    raw = dataclasses.replace(manifest, files=_RawFiles(manifest))
    out: dict[str, list[Range]] = {}
    for r in plan_requests(raw, targets, FETCH_BYTES):
        if r.plan.file in files:
            out.setdefault(r.plan.file, []).extend(_split(r))
    return out


def _split(r: Request) -> list[Range]:
    """One load request's chunks as ranges: runs of whole chunks that fill one stretch of one
    target (received there), and runs of the others (received into a buffer)."""
    p = r.plan
    ids = p.ids[r.first : r.stop]
    ncopies = np.diff(p.copy_first)[r.first : r.stop]
    whole = (p.direct[r.first : r.stop] & (ncopies == 1)).tolist()  # one copy, all of the chunk
    heads = p.copy_first[r.first : r.stop]
    out: list[Range] = []
    for offset, length, w, t, tp in zip(p.entry.offsets[ids].tolist(), p.entry.lengths[ids].tolist(), whole,
                                        p.copy_dest[heads].tolist(), p.copy_dest_pos[heads].tolist()):
        target, target_pos = (t, tp) if w else (-1, 0)
        last = out[-1] if out else None
        if last is not None and last.offset + last.length == offset and last.target == target and (
                target < 0 or last.target_pos + last.length == target_pos):
            out[-1] = last._replace(length=last.length + length)
        else:
            out.append(Range(offset, length, target, target_pos))
    return out


def assign(asks: list[dict[int, list[Ask]]], holders: dict[int, list[int]]) -> list[Transfer]:
    """Every rank's asks (``asks[receiver][saved rank]``), each served by one rank whose
    node holds that saved rank's files: receivers are spread over the holders. The order
    is the same on every rank (send and receive pair by order)."""
    out = []
    for receiver, wanted in enumerate(asks):
        for s in sorted(wanted):
            if not wanted[s]:
                continue
            hs = holders[s]
            out.append(Transfer(hs[receiver % len(hs)], receiver, s, tuple(wanted[s])))
    return out
