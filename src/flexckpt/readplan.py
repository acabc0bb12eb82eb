"""The read plan of a load: for each target piece (its layout at the current world
size), the saved pieces that intersect it, turned into the stored chunks to fetch and the
byte copies to make from each. Pieces on both sides are parts of boxes
(:mod:`flexshard.box`): a flat range is the whole tensor's box. Each shared stretch that is
contiguous in both the saved piece and the target is one run; a chunk is fetched once,
whatever the runs in it, and adjacent chunks in one request. Pure: no processes, no I/O."""
from __future__ import annotations

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


class ChunkRead(NamedTuple):
    """A stored chunk to fetch and the copies to make from it (a named tuple: a load plans
    thousands)."""

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


class _Runs:
    """The runs a load wants from one file: raw byte start, length, target, byte position
    in the target. A flat piece (every flexshard layout) adds its one run as plain ints; an
    n-D box adds its runs (one a row, maybe thousands) as arrays."""

    def __init__(self) -> None:
        self.ints: tuple[list[int], ...] = ([], [], [], [])
        self.arrays: list[tuple[np.ndarray, ...]] = []

    def columns(self) -> list[np.ndarray]:
        cols = [np.array(c, dtype=np.int64) for c in self.ints]
        if self.arrays:
            cols = [np.concatenate([c, *(a[k] for a in self.arrays)]) for k, c in enumerate(cols)]
        return cols


def plan_reads(manifest: Manifest, targets: list[tuple[SavedTensor, FlatRange | Part]]) -> list[ChunkRead]:
    """Chunks to fetch for ``targets`` (a saved tensor and the part of it wanted, stored
    contiguously in the target; or a flat range of it), each chunk once, in file order.
    Every wanted element must be in the checkpoint exactly once.

    The runs of every target are gathered per file (:func:`gather_runs`), then cut at the
    chunks' bounds in one vectorized pass a file (:func:`file_reads`): array calls per
    piece were most of a warm load's time."""
    by_file = gather_runs(targets)
    out: list[ChunkRead] = []
    for file in sorted(by_file):
        out += file_reads(file, manifest.files[file], by_file[file])
    return out


def gather_runs(targets: list[tuple[SavedTensor, FlatRange | Part]]) -> dict[str, list[np.ndarray]]:
    """The runs ``targets`` want, by data file: four int64 columns (raw byte start, length,
    target index, byte position in the target). Needs only the manifest's plan, not the
    files' chunk tables (:func:`file_reads` then cuts them at the chunks' bounds)."""
    by_file: dict[str, _Runs] = {}
    for t, (saved, want) in enumerate(targets):
        shape = saved.shape
        if isinstance(want, FlatRange):
            want = Part(whole(shape), want.start, want.stop)
        size = itemsize(saved.dtype)
        flat_want = want.box.sizes == shape
        found = 0
        for piece in saved.pieces_in(want):  # version 2: only the writers of the wanted part, recomputed
            acc = by_file.get(piece.file)
            if acc is None:
                acc = by_file[piece.file] = _Runs()
            if flat_want and piece.box is None:  # two flat ranges of the tensor share at most one run
                lo, hi = max(piece.start, want.start), min(piece.stop, want.stop)
                if lo < hi:
                    starts, lengths, dest, pos = acc.ints
                    starts.append(piece.raw_offset + (lo - piece.start) * size)
                    lengths.append((hi - lo) * size)
                    dest.append(t)
                    pos.append((lo - want.start) * size)
                    found += hi - lo
                continue
            shared = runs(Part(piece.box or whole(shape), piece.start, piece.stop), want)
            if len(shared):
                found += int(shared[:, 2].sum())
                acc.arrays.append((piece.raw_offset + shared[:, 0] * size, shared[:, 2] * size,
                                   np.full(len(shared), t, dtype=np.int64), shared[:, 1] * size))
        if found != len(want):
            raise ManifestError(
                f"tensor {saved.name!r}: the checkpoint's pieces hold {found} of the {len(want)} elements wanted "
                f"({want}); the checkpoint does not cover every element exactly once"
            )
    return {file: acc.columns() for file, acc in by_file.items()}


def file_reads(file: str, entry: FileEntry, columns: list[np.ndarray]) -> list[ChunkRead]:
    """:func:`gather_runs`' runs of ``file`` cut at its chunks' bounds (see :func:`_file_reads`)."""
    return _file_reads(file, entry, *columns)


def _file_reads(file: str, entry: FileEntry, starts: np.ndarray, nbytes: np.ndarray, dest: np.ndarray,
                dest_pos: np.ndarray) -> list[ChunkRead]:
    """The runs wanted from ``file`` (``nbytes`` raw bytes at ``starts``, landing at byte
    ``dest_pos`` of target ``dest``) cut at its chunks' bounds: the chunks they touch, in
    file order, each with its copies in the order the runs came."""
    if not len(starts):
        return []
    chunks = entry.chunks
    offsets = np.fromiter((c.raw_offset for c in chunks), dtype=np.int64, count=len(chunks))
    ends = offsets + np.fromiter((c.raw_length for c in chunks), dtype=np.int64, count=len(chunks))
    stops = starts + nbytes
    first = np.maximum(np.searchsorted(offsets, starts, "right") - 1, 0)
    count = np.searchsorted(offsets, stops, "left") - first  # the chunks each run touches
    run = np.repeat(np.arange(len(starts)), count)
    chunk = first[run] + np.arange(len(run)) - np.repeat(np.cumsum(count) - count, count)
    order = np.argsort(chunk, kind="stable")
    run, chunk = run[order], chunk[order]
    lo = np.maximum(starts[run], offsets[chunk])
    hi = np.minimum(stops[run], ends[chunk])
    if (hi <= lo).any() or int((hi - lo).sum()) != int(nbytes.sum()):
        raise ManifestError(f"data file {file}: the bytes a load wants are not all inside its chunks; the "
                            f"checkpoint's chunk table does not match its plan")
    copies = list(map(Copy, (lo - offsets[chunk]).tolist(), (hi - lo).tolist(), dest[run].tolist(),
                      (dest_pos[run] + lo - starts[run]).tolist()))
    cuts = (np.flatnonzero(np.diff(chunk)) + 1).tolist()
    ids = chunk.tolist()
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
