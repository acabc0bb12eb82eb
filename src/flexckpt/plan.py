"""The write plan: computed, not exchanged, and never for every rank at once.

From the global structure alone (names, dtypes, global shapes, layouts) and the plan
rules (alignment, chunk sizes) any rank computes, identically and with no communication:

* which rank writes each replicated tensor: the only global decision, made by a balancer
  over per-rank byte loads that are summed in closed form with numpy (O(tensors + W));
* its own pieces, their offsets in its stream and the chunks the stream is cut into
  (O(tensors) for one rank, :meth:`WritePlan.rank_plan`);
* the writers of any element range of a tensor (:meth:`WritePlan.writers`), in closed form
  from the layout, which is what a load needs to find the files it reads.

So the manifest stores none of it: only the rules' version and parameters. Pure functions:
no processes, no I/O.
"""
from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass
from typing import Iterator, NamedTuple, Sequence

import numpy as np

from flexckpt.dtypes import itemsize
from flexckpt.structure import TensorSpec
from flexshard import BlockShard, FlatRange, HybridShard, Owned, Replicate, Shard
from flexshard.layout import row_numel, write_range

ALIGN = 64  # every piece starts on a 64-byte boundary of its stream (any dtype view is aligned)
MIN_CHUNK = 64 << 10  # pieces at least this big get chunks of their own
CHUNKS_PER_PIECE = 16  # ... about this many, so a load that wants part of a piece reads little more
RULES_VERSION = 2  # version of the rules below; recorded in every manifest


@dataclass(frozen=True)
class PlanRules:
    """The parameters that, with the structure and the world size, fix every piece, offset
    and chunk of a checkpoint. Stored in the manifest instead of the pieces themselves."""

    chunk_bytes: int
    version: int = RULES_VERSION
    align: int = ALIGN
    min_chunk: int = MIN_CHUNK
    chunks_per_piece: int = CHUNKS_PER_PIECE

    def to_json(self) -> dict:
        return {
            "version": self.version, "align": self.align, "chunk_bytes": self.chunk_bytes,
            "min_chunk": self.min_chunk, "chunks_per_piece": self.chunks_per_piece,
        }


class Piece(NamedTuple):
    """Elements ``[start, stop)`` of tensor ``spec_index`` at byte ``offset`` of a stream.
    (Named tuples: a loading rank builds thousands for each file it reads.)"""

    spec_index: int
    start: int
    stop: int
    offset: int
    nbytes: int


class Chunk(NamedTuple):
    """Bytes ``[offset, offset + length)`` of a raw stream, compressed and checksummed alone."""

    offset: int
    length: int


@dataclass(frozen=True)
class RankPlan:
    pieces: tuple[Piece, ...]
    nbytes: int  # stream size, padding included
    chunks: tuple[Chunk, ...]


def _align(n: int, align: int = ALIGN) -> int:
    return -(-n // align) * align


class WritePlan:
    """The plan of one structure at one world size. Cheap to build (the replicated
    tensors' writers only); each rank's part is computed on demand and cached."""

    def __init__(self, specs: Sequence[TensorSpec], world_size: int, rules: PlanRules) -> None:
        if rules.chunk_bytes < rules.align:
            raise ValueError(f"chunk_bytes must be >= {rules.align}, got {rules.chunk_bytes}")
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        specs = sorted(specs, key=lambda s: s.name)
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate tensor names in state: {sorted({n for n in names if names.count(n) > 1})}")
        for s in specs:
            if isinstance(s.layout, HybridShard):
                s.layout.groups(world_size)  # refuses a world the group size does not divide
            elif isinstance(s.layout, Owned) and s.layout.owner >= world_size:
                s.layout.flat_range(s.shape, world_size, 0)  # raises, naming the fix
        self.world_size = world_size
        self.specs: tuple[TensorSpec, ...] = tuple(specs)
        self.rules = rules
        self.replicated_writer: dict[int, int] = _balance_replicated(self.specs, world_size)
        self.ranks = _Ranks(self)
        self._rank_plans: dict[int, RankPlan] = {}

    @property
    def chunk_bytes(self) -> int:
        return self.rules.chunk_bytes

    def rank_plan(self, rank: int) -> RankPlan:
        """Rank ``rank``'s pieces (in spec order), their offsets, and its chunks."""
        cached = self._rank_plans.get(rank)
        if cached is None:
            if not 0 <= rank < self.world_size:
                raise ValueError(f"rank must be in [0, {self.world_size}), got {rank!r}")
            cached = self._rank_plans[rank] = self._make_rank_plan(rank)
        return cached

    def _make_rank_plan(self, rank: int) -> RankPlan:
        pieces = []
        offset = 0
        for i, spec in enumerate(self.specs):
            rng = self._written_by(i, rank)
            if rng is None or not len(rng):
                continue
            nbytes = len(rng) * itemsize(spec.dtype)
            pieces.append(Piece(i, rng.start, rng.stop, offset, nbytes))
            offset = _align(offset + nbytes, self.rules.align)
        return RankPlan(tuple(pieces), offset, tuple(cut_chunks(pieces, offset, self.rules.chunk_bytes, self.rules)))

    def _written_by(self, i: int, rank: int) -> FlatRange | None:
        spec = self.specs[i]
        if isinstance(spec.layout, Replicate):
            return FlatRange(0, spec.numel) if self.replicated_writer.get(i) == rank else None
        return write_range(spec.layout, spec.shape, self.world_size, rank)

    def writers(self, i: int, rng: FlatRange) -> list[tuple[int, FlatRange]]:
        """``(rank, written range)`` of every rank whose written part of tensor ``i``
        intersects ``rng``, in element order: closed form for every known layout."""
        spec = self.specs[i]
        if not len(rng):
            return []
        layout, w, n = spec.layout, self.world_size, spec.numel
        if isinstance(layout, Replicate):
            r = self.replicated_writer.get(i)
            return [] if r is None else [(r, FlatRange(0, n))]
        if isinstance(layout, Owned):
            return [(layout.owner, FlatRange(0, n))]
        if isinstance(layout, (Shard, BlockShard)):
            span = layout.rows_per_rank(spec.shape, w) * row_numel(spec.shape)
            return [(k, FlatRange(k * span, min((k + 1) * span, n))) for k in range(rng.start // span, min(w, -(-rng.stop // span)))]
        if isinstance(layout, HybridShard):
            g_size, replicas = layout.group_size, layout.groups(w)
            span = layout.rows_per_rank(spec.shape, w) * row_numel(spec.shape)
            out = []
            for p in range(rng.start // span, min(g_size, -(-rng.stop // span))):
                start, stop = p * span, min((p + 1) * span, n)
                m = stop - start
                bound = lambda g: start + g * m // replicas  # noqa: E731 - part g starts here
                first = max(bisect.bisect_right(range(replicas + 1), rng.start, key=bound) - 1, 0)
                for g in range(first, replicas):
                    part = FlatRange(bound(g), bound(g + 1))
                    if part.start >= rng.stop:
                        break
                    if len(part):
                        out.append((g * g_size + p, part))
            return out
        # an unknown layout: ask every rank (O(W), correct for any partitioning layout)
        return [(r, x) for r in range(w) if len(x := write_range(layout, spec.shape, w, r)) and x.intersect(rng)]


class _Ranks(Sequence[RankPlan]):
    """``plan.ranks[r]``: rank plans on demand (iterating builds every one: tests only)."""

    def __init__(self, plan: WritePlan) -> None:
        self._plan = plan

    def __len__(self) -> int:
        return self._plan.world_size

    def __getitem__(self, r):  # type: ignore[override]
        if isinstance(r, slice):
            return [self[i] for i in range(*r.indices(len(self)))]
        if not -len(self) <= r < len(self):
            raise IndexError(r)
        return self._plan.rank_plan(r % len(self))

    def __iter__(self) -> Iterator[RankPlan]:
        return (self._plan.rank_plan(r) for r in range(len(self)))


def make_write_plan(specs: Sequence[TensorSpec], world_size: int, chunk_bytes: int) -> WritePlan:
    """Each sharded piece is written by the rank that holds it (a ``HybridShard`` piece by
    all its replicas, a part each); each replicated tensor once, by the least-loaded rank
    (largest first, ties by name then rank), so no rank writes much more than another."""
    if chunk_bytes < ALIGN:
        raise ValueError(f"chunk_bytes must be >= {ALIGN}, got {chunk_bytes}")
    return WritePlan(specs, world_size, PlanRules(chunk_bytes))


# -- the one global decision: who writes each replicated tensor --------------------------------
def sharded_loads(specs: Sequence[TensorSpec], world_size: int) -> np.ndarray:
    """Bytes each rank writes for the non-replicated tensors, summed in closed form:
    O(tensors + W) numpy work (a difference array for row splits), plus O(W) per distinct
    ``HybridShard`` tensor shape."""
    w = world_size
    diff = np.zeros(w + 1, dtype=np.int64)  # prefix-summed: spans held by a run of ranks
    point = np.zeros(w, dtype=np.int64)
    hybrid: dict[tuple, int] = {}
    for spec in specs:
        n, size, layout = spec.numel, itemsize(spec.dtype), spec.layout
        if not n or isinstance(layout, Replicate):
            continue
        if isinstance(layout, Owned):
            point[layout.owner] += n * size
        elif isinstance(layout, (Shard, BlockShard)):
            span = layout.rows_per_rank(spec.shape, w) * row_numel(spec.shape)
            full, rest = divmod(n, span)
            diff[0] += span * size
            diff[full] -= span * size
            if rest:
                point[full] += rest * size
        elif isinstance(layout, HybridShard):
            key = (spec.shape, layout, size)
            hybrid[key] = hybrid.get(key, 0) + 1
        else:
            for r in range(w):
                point[r] += len(write_range(layout, spec.shape, w, r)) * size
    loads = np.cumsum(diff)[:w] + point
    for (shape, layout, size), count in hybrid.items():
        loads += count * size * _hybrid_parts(shape, layout, w)
    return loads


def _hybrid_parts(shape: tuple[int, ...], layout: HybridShard, w: int) -> np.ndarray:
    """Elements each rank writes of one ``HybridShard`` tensor (rank = group * G + position)."""
    g_size, replicas = layout.group_size, layout.groups(w)
    n = int(np.prod(shape, dtype=np.int64)) if shape else 1
    span = layout.rows_per_rank(shape, w) * row_numel(shape)
    pos = np.arange(g_size, dtype=np.int64)
    piece = np.clip(n - pos * span, 0, span)  # elements held by each position
    g = np.arange(replicas + 1, dtype=np.int64)[:, None]
    bounds = g * piece[None, :] // replicas  # (replicas + 1, G)
    return (bounds[1:] - bounds[:-1]).reshape(-1)


def _balance_replicated(specs: Sequence[TensorSpec], world_size: int) -> dict[int, int]:
    replicated = [i for i, s in enumerate(specs) if isinstance(s.layout, Replicate) and s.numel]
    if not replicated:
        return {}
    loads = sharded_loads(specs, world_size)
    heap = list(zip(loads.tolist(), range(world_size)))
    heapq.heapify(heap)
    out = {}
    for i in sorted(replicated, key=lambda i: (-specs[i].numel * itemsize(specs[i].dtype), specs[i].name)):
        nbytes = specs[i].numel * itemsize(specs[i].dtype)
        load, r = heapq.heappop(heap)
        out[i] = r
        heapq.heappush(heap, (load + nbytes, r))
    return out


# -- chunks ----------------------------------------------------------------------------------
def piece_chunk_bytes(nbytes: int, chunk_bytes: int, rules: PlanRules | None = None) -> int:
    """Chunk size for a piece of ``nbytes``: about 1/16 of it, at least MIN_CHUNK (or
    ``chunk_bytes`` if smaller), at most ``chunk_bytes``."""
    min_chunk = MIN_CHUNK if rules is None else rules.min_chunk
    per_piece = CHUNKS_PER_PIECE if rules is None else rules.chunks_per_piece
    align = ALIGN if rules is None else rules.align
    return min(chunk_bytes, max(min_chunk, _align(-(-nbytes // per_piece), align)))


def cut_chunks(pieces: list[Piece], total: int, chunk_bytes: int, rules: PlanRules | None = None) -> list[Chunk]:
    """Tile ``[0, total)`` with chunks of at most ``chunk_bytes``.

    A piece of at least MIN_CHUNK gets chunks of its own, about 1/16 of the piece each, so
    that a resharding load, which wants part of a piece, fetches (and verifies) little more
    than that part, and a load that wants a whole chunk reads it straight into the target.
    Smaller pieces share chunks of up to MIN_CHUNK."""
    chunks: list[Chunk] = []
    group_limit = min(MIN_CHUNK if rules is None else rules.min_chunk, chunk_bytes)

    def close(start: int, stop: int, size: int) -> None:
        for o in range(start, stop, size):
            chunks.append(Chunk(o, min(size, stop - o)))

    group = 0
    for p in pieces:
        if p.nbytes >= group_limit:
            close(group, p.offset, group_limit)
            close(p.offset, p.offset + p.nbytes, piece_chunk_bytes(p.nbytes, chunk_bytes, rules))
            group = p.offset + p.nbytes
        elif p.offset + p.nbytes - group > group_limit:
            close(group, p.offset, group_limit)
            group = p.offset
    close(group, total, group_limit)
    return chunks


__all__ = [
    "ALIGN", "Chunk", "PlanRules", "Piece", "RankPlan", "WritePlan", "cut_chunks", "make_write_plan",
    "piece_chunk_bytes", "sharded_loads",
]
