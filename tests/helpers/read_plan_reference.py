"""The reference read planner the property tests compare the load's own planner against
(:func:`flexckpt.load.read_plan.plan_requests`): the same plan, one object a chunk
(:class:`ChunkRead`) and a copy (:class:`Copy`), and :func:`coalesce` grouping the chunks
into ranged reads (:class:`Fetch`). It shares the runs (:func:`flexckpt.load.read_plan.gather_runs`)
and their cut at the chunks' bounds (:func:`flexckpt.load.read_plan.cut_runs`) with the load; the
objects are built from them here. A helper module: no tests of its own."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from flexckpt.format.manifest import FileEntry, Manifest, SavedTensor, StoredChunk
from flexckpt.load.read_plan import cut_runs, gather_runs
from flexshard import FlatRange, Part


class Copy(NamedTuple):
    """``nbytes`` raw bytes at ``chunk_pos`` of a chunk go to byte ``target_pos`` of
    target ``target``."""

    chunk_pos: int
    nbytes: int
    target: int
    target_pos: int


class ChunkRead(NamedTuple):
    """A stored chunk to fetch and the copies to make from it."""

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
    by_file = gather_runs(targets)
    out: list[ChunkRead] = []
    for file in sorted(by_file):
        out += file_reads(file, manifest.files[file], by_file[file])
    return out


def file_reads(file: str, entry: FileEntry, columns: list[np.ndarray]) -> list[ChunkRead]:
    """:func:`gather_runs`' runs of ``file`` cut at its chunks' bounds: the chunks they touch,
    in file order, each with its copies in the order the runs came."""
    chunk, chunk_pos, nbytes, dest, dest_pos = cut_runs(file, entry, *columns)
    if not len(chunk):
        return []
    copies = list(map(Copy, chunk_pos.tolist(), nbytes.tolist(), dest.tolist(), dest_pos.tolist()))
    cuts = (np.flatnonzero(np.diff(chunk)) + 1).tolist()
    ids = chunk.tolist()
    chunks = entry.chunks
    return [ChunkRead(file, chunks[ids[a]], tuple(copies[a:b])) for a, b in zip([0, *cuts], [*cuts, len(ids)])]


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
