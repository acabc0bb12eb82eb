"""The write plan: computed, not exchanged.

From the global structure alone (names, dtypes, global shapes, layouts) every rank
computes the same plan: which rank writes which piece of which tensor, where each piece
sits in that rank's data stream, and how each stream is cut into chunks. Pure functions:
no processes, no I/O.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

from flexckpt.dtypes import itemsize
from flexckpt.structure import TensorSpec
from flexshard import Replicate

ALIGN = 64  # every piece starts on a 64-byte boundary of its stream (any dtype view is aligned)


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, stop)`` of tensor ``spec_index`` at byte ``offset`` of a stream."""

    spec_index: int
    start: int
    stop: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Chunk:
    """Bytes ``[offset, offset + length)`` of a raw stream, compressed and checksummed alone."""

    offset: int
    length: int


@dataclass(frozen=True)
class RankPlan:
    pieces: tuple[Piece, ...]
    nbytes: int  # stream size, padding included
    chunks: tuple[Chunk, ...]


@dataclass(frozen=True)
class WritePlan:
    world_size: int
    specs: tuple[TensorSpec, ...]  # sorted by name
    ranks: tuple[RankPlan, ...]


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def make_write_plan(specs: list[TensorSpec], world_size: int, chunk_bytes: int) -> WritePlan:
    """Each sharded piece is written by the rank that holds it; each replicated tensor once,
    by the least-loaded rank (largest first, ties by name then rank), so no rank writes much
    more than another."""
    if chunk_bytes < ALIGN:
        raise ValueError(f"chunk_bytes must be >= {ALIGN}, got {chunk_bytes}")
    specs = sorted(specs, key=lambda s: s.name)
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate tensor names in state: {sorted({n for n in names if names.count(n) > 1})}")
    # (spec index, start, stop) per rank, in spec order
    owned: list[list[tuple[int, int, int]]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    replicated = []
    for i, spec in enumerate(specs):
        size = itemsize(spec.dtype)
        if isinstance(spec.layout, Replicate):
            if spec.numel:
                replicated.append(i)
            continue
        for r in range(world_size):
            rng = spec.layout.flat_range(spec.shape, world_size, r)
            if len(rng):
                owned[r].append((i, rng.start, rng.stop))
                load[r] += len(rng) * size
    heap = [(load[r], r) for r in range(world_size)]
    heapq.heapify(heap)
    for i in sorted(replicated, key=lambda i: (-specs[i].numel * itemsize(specs[i].dtype), specs[i].name)):
        spec = specs[i]
        bytes_, r = heapq.heappop(heap)
        owned[r].append((i, 0, spec.numel))
        heapq.heappush(heap, (bytes_ + spec.numel * itemsize(spec.dtype), r))
    ranks = []
    for r in range(world_size):
        pieces = []
        offset = 0
        for i, start, stop in sorted(owned[r]):
            nbytes = (stop - start) * itemsize(specs[i].dtype)
            pieces.append(Piece(i, start, stop, offset, nbytes))
            offset = _align(offset + nbytes)
        ranks.append(RankPlan(tuple(pieces), offset, tuple(cut_chunks(pieces, offset, chunk_bytes))))
    return WritePlan(world_size, tuple(specs), tuple(ranks))


MIN_CHUNK = 64 << 10  # pieces at least this big get chunks of their own
CHUNKS_PER_PIECE = 16  # ... about this many, so a load that wants part of a piece reads little more


def piece_chunk_bytes(nbytes: int, chunk_bytes: int) -> int:
    """Chunk size for a piece of ``nbytes``: about 1/16 of it, at least MIN_CHUNK (or
    ``chunk_bytes`` if smaller), at most ``chunk_bytes``."""
    return min(chunk_bytes, max(MIN_CHUNK, _align(-(-nbytes // CHUNKS_PER_PIECE))))


def cut_chunks(pieces: list[Piece], total: int, chunk_bytes: int) -> list[Chunk]:
    """Tile ``[0, total)`` with chunks of at most ``chunk_bytes``.

    A piece of at least MIN_CHUNK gets chunks of its own, about 1/16 of the piece each, so
    that a resharding load, which wants part of a piece, fetches (and verifies) little more
    than that part, and a load that wants a whole chunk reads it straight into the target.
    Smaller pieces share chunks of up to MIN_CHUNK."""
    chunks: list[Chunk] = []
    group_limit = min(MIN_CHUNK, chunk_bytes)

    def close(start: int, stop: int, size: int) -> None:
        for o in range(start, stop, size):
            chunks.append(Chunk(o, min(size, stop - o)))

    group = 0
    for p in pieces:
        if p.nbytes >= group_limit:
            close(group, p.offset, group_limit)
            close(p.offset, p.offset + p.nbytes, piece_chunk_bytes(p.nbytes, chunk_bytes))
            group = p.offset + p.nbytes
        elif p.offset + p.nbytes - group > group_limit:
            close(group, p.offset, group_limit)
            group = p.offset
    close(group, total, group_limit)
    return chunks
