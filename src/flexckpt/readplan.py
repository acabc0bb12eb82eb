"""The read plan of a load: for each target piece (its layout at the current world
size), the saved pieces that intersect it, turned into the stored chunks to fetch and the
byte copies to make from each. Pieces on both sides are parts of boxes
(:mod:`flexshard.box`): a flat range is the whole tensor's box. Each shared stretch that is
contiguous in both the saved piece and the target is one run; a chunk is fetched once,
whatever the runs in it, and adjacent chunks in one request. Pure: no processes, no I/O."""
from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from flexckpt.dtypes import itemsize
from flexckpt.errors import ManifestError
from flexckpt.manifest import FileEntry, Manifest, SavedTensor, StoredChunk
from flexshard import FlatRange, Part, runs
from flexshard.box import whole


class Copy(NamedTuple):
    """``nbytes`` raw bytes at ``chunk_pos`` of a chunk go to byte ``target_pos`` of
    target ``target``."""

    chunk_pos: int
    nbytes: int
    target: int
    target_pos: int


@dataclass(frozen=True)
class ChunkRead:
    file: str
    chunk: StoredChunk
    copies: tuple[Copy, ...]

    @property
    def whole(self) -> bool:
        """The chunk lands, uncompressed and entire, in one contiguous stretch of one target:
        it can be read straight into that target."""
        return (
            self.chunk.codec == "none"
            and len(self.copies) == 1
            and self.copies[0].chunk_pos == 0
            and self.copies[0].nbytes == self.chunk.raw_length
        )


def plan_reads(manifest: Manifest, targets: list[tuple[SavedTensor, FlatRange | Part]]) -> list[ChunkRead]:
    """Chunks to fetch for ``targets`` (a saved tensor and the part of it wanted, stored
    contiguously in the target; or a flat range of it), each chunk once, in file order.
    Every wanted element must be in the checkpoint exactly once."""
    wanted: dict[tuple[str, int], list[Copy]] = {}
    offsets: dict[str, np.ndarray] = {}
    entries: dict[str, FileEntry] = {}  # a version-2 manifest's entry lookup takes a lock
    for t, (saved, want) in enumerate(targets):
        if isinstance(want, FlatRange):
            want = Part(whole(saved.shape), want.start, want.stop)
        size = itemsize(saved.dtype)
        pieces = saved.pieces_in(want)  # version 2: only the writers of the wanted part, recomputed
        found = 0
        for piece in pieces:
            src = Part(piece.box or whole(saved.shape), piece.start, piece.stop)
            shared = runs(src, want)
            if not len(shared):
                continue
            entry = entries.get(piece.file)
            if entry is None:
                entry = entries[piece.file] = manifest.files[piece.file]
                offsets[piece.file] = np.array([c.raw_offset for c in entry.chunks], dtype=np.int64)
            found += int(shared[:, 2].sum())
            _copies(wanted, piece.file, entry, offsets[piece.file], t, piece.raw_offset + shared[:, 0] * size,
                    shared[:, 2] * size, shared[:, 1] * size)
        if found != len(want):
            raise ManifestError(
                f"tensor {saved.name!r}: the checkpoint's pieces hold {found} of the {len(want)} elements wanted "
                f"({want}); the checkpoint does not cover every element exactly once"
            )
    return [
        ChunkRead(file, entries[file].chunks[ci], tuple(copies))
        for (file, ci), copies in sorted(wanted.items())
    ]


def _copies(wanted: dict, file: str, entry: FileEntry, offsets: np.ndarray, t: int, starts: np.ndarray,
            nbytes: np.ndarray, target_pos: np.ndarray) -> None:
    """The copies of runs (raw byte ``starts`` in ``file``, ``nbytes`` long, landing at
    ``target_pos`` of target ``t``), filed under the chunk that holds each: runs come in
    stream order, so a chunk's runs are consecutive and filed at once (a box read into a
    wider target is a run a row: thousands per tensor)."""
    first = np.searchsorted(offsets, starts, "right") - 1
    last = np.searchsorted(offsets, starts + nbytes, "left")
    inside = last - first == 1
    if inside.all():
        cuts = np.flatnonzero(np.diff(first)) + 1
        at = (starts - offsets[first]).tolist()
        n, pos, chunk = nbytes.tolist(), target_pos.tolist(), first.tolist()
        for lo, hi in zip([0, *cuts.tolist()], [*cuts.tolist(), len(chunk)]):
            wanted.setdefault((file, chunk[lo]), []).extend(
                map(Copy, at[lo:hi], n[lo:hi], itertools.repeat(t, hi - lo), pos[lo:hi]))
        return
    offs = offsets.tolist()
    for raw_start, length, tpos in zip(starts.tolist(), nbytes.tolist(), target_pos.tolist()):
        raw_stop = raw_start + length
        for ci in _chunks_between(offs, raw_start, raw_stop):
            c = entry.chunks[ci]
            lo, hi = max(raw_start, c.raw_offset), min(raw_stop, c.raw_offset + c.raw_length)
            wanted.setdefault((file, ci), []).append(Copy(lo - c.raw_offset, hi - lo, t, tpos + (lo - raw_start)))


def _chunks_between(offsets: list[int], start: int, stop: int) -> range:
    """Indices of the chunks (given by their raw start offsets) that hold bytes [start, stop)."""
    first = bisect.bisect_right(offsets, start) - 1
    last = bisect.bisect_left(offsets, stop)
    return range(max(first, 0), last)


@dataclass(frozen=True)
class Fetch:
    """One ranged read of consecutive stored chunks of one file."""

    file: str
    offset: int
    length: int
    reads: tuple[ChunkRead, ...]


def coalesce(reads: list[ChunkRead], max_bytes: int) -> list[Fetch]:
    """Merge reads of adjacent chunks (same file, touching byte ranges) into fetches of at
    most ``max_bytes`` (a single chunk may exceed it)."""
    fetches: list[Fetch] = []
    run: list[ChunkRead] = []

    def flush() -> None:
        if run:
            start = run[0].chunk.offset
            end = run[-1].chunk.offset + run[-1].chunk.length
            fetches.append(Fetch(run[0].file, start, end - start, tuple(run)))

    for cr in reads:
        if run:
            last = run[-1]
            touching = cr.file == last.file and cr.chunk.offset == last.chunk.offset + last.chunk.length
            if touching and cr.chunk.offset + cr.chunk.length - run[0].chunk.offset <= max_bytes:
                run.append(cr)
                continue
            flush()
        run = [cr]
    flush()
    return fetches
