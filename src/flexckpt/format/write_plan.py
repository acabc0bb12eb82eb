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
import functools
import zlib
import heapq
import itertools
import math
from dataclasses import dataclass
from typing import Iterator, NamedTuple, Sequence

import numpy as np

from flexckpt.state.dtypes import itemsize
from flexckpt.state.structure import TensorSpec
from flexshard import BlockShard, Box, FlatRange, HybridShard, MeshLayout, Owned, Part, Replicate, Shard
from flexshard.box import bounding_box, box_part, whole
from flexshard.layout import row_numel

CHUNK_BYTES_DEFAULT = 2 << 20
ALIGN = 64  # every piece starts on a 64-byte boundary of its stream (any dtype view is aligned)
MIN_CHUNK = 64 << 10  # pieces at least this big get chunks of their own
CHUNKS_PER_PIECE = 16  # ... about this many, so a load that wants part of a piece reads little more
HYBRID_PART_BYTES = 1 << 20  # a HybridShard piece is written in parts of about this size, spread over its replicas
RULES_VERSION = 4  # version of the rules below; recorded in every manifest
# 3 adds who writes a MeshLayout box; 2 is the same rules without it; 4 makes the writers of
# a tensor on a mesh spanning part of the world (a pipeline stage's) a function of that
# tensor alone, so that ranks with different structures plan alike (see part_of_world)
READ_RULES_VERSIONS = (2, 3, 4)


@dataclass(frozen=True)
class PlanRules:
    """The parameters that, with the structure and the world size, fix every piece, offset
    and chunk of a checkpoint. Stored in the manifest instead of the pieces themselves."""

    chunk_bytes: int
    version: int = RULES_VERSION
    align: int = ALIGN
    min_chunk: int = MIN_CHUNK
    chunks_per_piece: int = CHUNKS_PER_PIECE
    hybrid_part_bytes: int = HYBRID_PART_BYTES

    def to_json(self) -> dict:
        return {
            "version": self.version, "align": self.align, "chunk_bytes": self.chunk_bytes,
            "min_chunk": self.min_chunk, "chunks_per_piece": self.chunks_per_piece,
            "hybrid_part_bytes": self.hybrid_part_bytes,
        }


class Piece(NamedTuple):
    """Elements ``[start, stop)`` of ``box`` (row-major in the box; None: the whole tensor)
    of tensor ``spec_index``, at byte ``offset`` of a stream: the one geometry of
    :mod:`flexshard.box`. (Named tuples: a loading rank builds thousands for each file it
    reads.)"""

    spec_index: int
    start: int
    stop: int
    offset: int
    nbytes: int
    box: Box | None = None


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
        self.spec_index = {name: i for i, name in enumerate(names)}  # a spec's index, by its name
        if len(self.spec_index) != len(names):
            raise ValueError(f"duplicate tensor names in state: {sorted({n for n in names if names.count(n) > 1})}")
        for s in specs:
            if isinstance(s.layout, HybridShard):
                s.layout.groups(world_size)  # refuses a world the group size does not divide
            elif isinstance(s.layout, Owned) and s.layout.owner >= world_size:
                s.layout.flat_range(s.shape, world_size, 0)  # raises, naming the fix
            elif isinstance(s.layout, MeshLayout):
                s.layout.check(s.shape, world_size)
        self.world_size = world_size
        self.specs: tuple[TensorSpec, ...] = tuple(specs)
        self.rules = rules
        self.replicated_writer: dict[int, int] = _balance_replicated(self.specs, world_size, rules)
        self.ranks = _Ranks(self)
        self._rank_plans: dict[int, RankPlan] = {}
        self._rank_pieces: dict[int, tuple[list[Piece], int]] = {}
        self._offsets: dict[int, dict[int, int]] = {}
        self._wholes: dict[int, Box] = {}
        self._chunk_columns: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.geometry = _geometries(self.specs, world_size, rules)  # each spec's shape of pieces (the read plan's columns use it)

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

    def chunk_columns(self, rank: int) -> tuple[np.ndarray, np.ndarray]:
        """Rank ``rank``'s chunks as two int64 columns, raw offset and raw length, computed
        once (read-only: every load of the structure shares them)."""
        cached = self._chunk_columns.get(rank)
        if cached is None:
            chunks = self.rank_plan(rank).chunks
            bounds = np.fromiter(itertools.chain.from_iterable(chunks), dtype=np.int64, count=2 * len(chunks))
            bounds.flags.writeable = False
            cached = self._chunk_columns[rank] = (bounds[0::2], bounds[1::2])
        return cached

    def rank_pieces(self, rank: int) -> tuple[list[Piece], int]:
        """Rank ``rank``'s pieces and its stream's length, without cutting chunks: O(tensors),
        whatever the sizes (a reader checks the length before it lets chunks be cut)."""
        cached = self._rank_pieces.get(rank)
        if cached is None:
            cached = self._rank_pieces[rank] = self._make_rank_pieces(rank)
        return cached

    def offsets(self, rank: int) -> dict[int, int]:
        """Where each tensor's piece starts in rank ``rank``'s stream, by spec index (pieces
        only: no chunks cut)."""
        cached = self._offsets.get(rank)
        if cached is None:
            cached = self._offsets[rank] = {p.spec_index: p.offset for p in self.rank_pieces(rank)[0]}
        return cached

    def _whole(self, i: int) -> Box:
        box = self._wholes.get(i)
        if box is None:
            box = self._wholes[i] = whole(self.specs[i].shape)
        return box

    def _make_rank_pieces(self, rank: int) -> tuple[list[Piece], int]:
        pieces = []
        offset = 0
        align = self.rules.align
        for i, (spec, geo) in enumerate(zip(self.specs, self.geometry)):
            if geo.kind == "mesh":  # a box, written whole by one of its holders
                part = self._mesh_written_by(i, rank)
                if part is None or part.stop <= part.start:
                    continue
                start, stop, box = part.start, part.stop, None if part.box.sizes == spec.shape else part.box
            else:  # a flat range of the whole tensor (box None)
                rng = self._flat_written_by(i, rank)
                if rng is None or rng.stop <= rng.start:
                    continue
                start, stop, box = rng.start, rng.stop, None
            nbytes = (stop - start) * itemsize(spec.dtype)
            pieces.append(Piece(i, start, stop, offset, nbytes, box))
            offset = _align(offset + nbytes, align)
        return pieces, offset

    def _make_rank_plan(self, rank: int) -> RankPlan:
        pieces, offset = self.rank_pieces(rank)
        return RankPlan(tuple(pieces), offset, tuple(cut_chunks(pieces, offset, self.rules.chunk_bytes, self.rules)))

    def _flat_written_by(self, i: int, rank: int) -> FlatRange | None:
        geo = self.geometry[i]
        n, span = geo.n, geo.span
        if geo.kind == "rows":
            start = min(rank * span, n)
            return FlatRange(start, min(start + span, n))
        if geo.kind == "hybrid":
            g, p = divmod(rank, geo.group)
            j = (g - geo.first - p) % geo.replicas  # the part of its group's piece this replica writes
            if j >= geo.parts:
                return None
            start = min(p * span, n)
            m = min(start + span, n) - start
            return FlatRange(start + j * m // geo.parts, start + (j + 1) * m // geo.parts)
        if geo.kind == "replicate":
            return FlatRange(0, n) if self.replicated_writer.get(i) == rank else None
        spec = self.specs[i]
        return spec.layout.flat_range(spec.shape, self.world_size, rank)

    def _mesh_written_by(self, i: int, rank: int) -> Part | None:
        """A box is written whole by one of the ranks that hold it: replica
        ``(first + box index) mod replicas`` along the mesh's replicate dims."""
        spec, geo = self.specs[i], self.geometry[i]
        layout: MeshLayout = spec.layout  # type: ignore[assignment]
        coord = layout.coordinate(rank)
        if coord is None or _replica(layout, coord) != (geo.first + _box_index(layout, coord)) % geo.replicas:
            return None
        return box_part(layout.box(spec.shape, self.world_size, rank))

    def writers(self, i: int, want: "FlatRange | Part") -> list[tuple[int, Part]]:
        """``(rank, written part)`` of every rank whose written part of tensor ``i`` may
        hold elements of ``want`` (a part, or a flat range of the whole tensor): closed
        form for every known layout, in element order for the flat ones."""
        spec = self.specs[i]
        if want.stop <= want.start:
            return []
        if self.geometry[i].kind == "mesh":
            return self._mesh_writers(i, Part(self._whole(i), want.start, want.stop) if isinstance(want, FlatRange) else want)
        if isinstance(want, FlatRange) or want.box.sizes == spec.shape:
            return self._flat_writers(i, want.start, want.stop)
        # a box wanted of a flat layout: the flat span from its first element to its last
        shape, b = spec.shape, want.box
        strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
        first = sum(o * st for o, st in zip(b.offsets, strides))
        last = sum((o + n - 1) * st for o, n, st in zip(b.offsets, b.sizes, strides))
        return self._flat_writers(i, first, last + 1)

    def _mesh_writers(self, i: int, want: Part) -> list[tuple[int, Part]]:
        spec, geo = self.specs[i], self.geometry[i]
        layout: MeshLayout = spec.layout  # type: ignore[assignment]
        bound = bounding_box(want)
        if bound is None:
            return []
        per_dim = []  # for each tensor dim: [(coordinates of the mesh dims sharding it, interval)]
        for d, n in enumerate(spec.shape):
            dims = layout.shard_dims(d)
            lo, hi = bound.offsets[d], bound.offsets[d] + bound.sizes[d]
            entries, starts, stops = _dim_intervals(layout, n, d)
            hits = entries[bisect.bisect_right(stops, lo):bisect.bisect_left(starts, hi)]
            per_dim.append((dims, hits))
        out = []
        coord = [0] * len(layout.mesh)
        for combo in itertools.product(*(hits for _dims, hits in per_dim)):
            for (dims, _hits), (c, _iv) in zip(per_dim, combo):
                for m, x in zip(dims, c):
                    coord[m] = x
            for m, x in zip(layout.replicate_dims(), _unravel((geo.first + _box_index(layout, coord)) % geo.replicas,
                                                               [layout.mesh[m] for m in layout.replicate_dims()])):
                coord[m] = x
            box = Box(tuple(iv[0] for _c, iv in combo), tuple(iv[1] - iv[0] for _c, iv in combo))
            out.append((layout.rank_at(coord), box_part(box)))
        return out

    def _flat_writers(self, i: int, lo: int, hi: int) -> list[tuple[int, Part]]:
        """The writers of elements ``[lo, hi)`` (not empty) of a flat-layout tensor, with the
        flat ranges they write as parts of the whole tensor."""
        box = self._whole(i)
        return [(r, Part(box, a, b)) for r, a, b in self.flat_spans(i, lo, hi)]

    def flat_spans(self, i: int, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """:meth:`writers` of elements ``[lo, hi)`` (not empty) of a flat-layout tensor as
        ``(rank, start, stop)``: the flat ranges they write, no object each (a load asks
        once a tensor)."""
        geo, w = self.geometry[i], self.world_size
        n, span = geo.n, geo.span
        if geo.kind == "replicate":
            r = self.replicated_writer.get(i)
            return [] if r is None else [(r, 0, n)]
        if geo.kind == "rows":
            return [(k, k * span, min(k * span + span, n)) for k in range(lo // span, min(w, -(-hi // span)))]
        if geo.kind == "hybrid":
            out = []
            for p in range(lo // span, min(geo.group, -(-hi // span))):
                start = p * span
                m = min(start + span, n) - start
                bound = lambda j: start + j * m // geo.parts  # noqa: E731 - part j starts here
                first = max(bisect.bisect_right(range(geo.parts + 1), lo, key=bound) - 1, 0)
                for j in range(first, geo.parts):
                    a, b = bound(j), bound(j + 1)
                    if a >= hi:
                        break
                    if b > a:
                        out.append((((geo.first + p + j) % geo.replicas) * geo.group + p, a, b))
            return out
        spec, rng = self.specs[i], FlatRange(lo, hi)  # Owned, or a layout without closed form here: every holder
        return [(r, x.start, x.stop) for r in range(w)
                if len(x := spec.layout.flat_range(spec.shape, w, r)) and x.intersect(rng)]


def _box_index(layout: MeshLayout, coord: Sequence[int]) -> int:
    """Row-major index of a box among the boxes of the mesh's sharding dims."""
    out = 0
    for m, (kind, _d, _sf) in enumerate(layout.parsed):
        if kind != "R":
            out = out * layout.mesh[m] + coord[m]
    return out


def _replica(layout: MeshLayout, coord: Sequence[int]) -> int:
    out = 0
    for m, (kind, _d, _sf) in enumerate(layout.parsed):
        if kind == "R":
            out = out * layout.mesh[m] + coord[m]
    return out


def _unravel(index: int, sizes: Sequence[int]) -> list[int]:
    out = []
    for k in reversed(sizes):
        index, c = divmod(index, k)
        out.append(c)
    return out[::-1]


_INTERVALS: dict[tuple, tuple] = {}


def _dim_intervals(layout: MeshLayout, size: int, d: int) -> tuple[list, list[int], list[int]]:
    """The non-empty ``(coordinates of the mesh dims sharding dim d, interval)`` along dim
    ``d``, sorted (they are disjoint), with their starts and stops for bisection; cached
    per (mesh, placements, size, dim)."""
    key = (layout.mesh, layout.placements, size, d)
    hit = _INTERVALS.get(key)
    if hit is None:
        entries = sorted(((c, iv) for c, iv in layout.dim_intervals(size, d) if iv[1] > iv[0]), key=lambda e: e[1])
        hit = (entries, [iv[0] for _c, iv in entries], [iv[1] for _c, iv in entries])
        if len(_INTERVALS) > 4096:
            _INTERVALS.clear()
        _INTERVALS[key] = hit
    return hit


class _Geometry(NamedTuple):
    """What the range math of one tensor's layout needs, computed once per plan. ``span``:
    elements of one rank's (or, for HybridShard, one position's) piece. HybridShard only:
    ``group``, ``replicas``, ``parts`` (each position's piece is cut into this many
    near-equal parts, one per replica, about ``hybrid_part_bytes`` each) and ``first``
    (which replica writes part 0 of position 0: a cursor running over the plan's
    HybridShard tensors, so that the parts of consecutive tensors go round the replicas)."""

    kind: str  # replicate, rows (Shard, BlockShard), hybrid, mesh, other
    n: int
    span: int = 0
    group: int = 1
    replicas: int = 1
    parts: int = 1
    first: int = 0


def _geometries(specs: Sequence[TensorSpec], world_size: int, rules: PlanRules) -> list[_Geometry]:
    out = []
    cursor = 0
    spans: dict[tuple, int] = {}  # a row split's span, by (layout, shape): most tensors share a few
    for spec in specs:
        layout, n = spec.layout, spec.numel
        if isinstance(layout, Replicate):
            out.append(_Geometry("replicate", n, n))
        elif isinstance(layout, (Shard, BlockShard)):
            span = spans.get((layout, spec.shape))
            if span is None:
                span = spans[layout, spec.shape] = layout.rows_per_rank(spec.shape, world_size) * row_numel(spec.shape)
            out.append(_Geometry("rows", n, span))
        elif isinstance(layout, HybridShard):
            span = layout.rows_per_rank(spec.shape, world_size) * row_numel(spec.shape)
            replicas = layout.groups(world_size)
            parts = max(1, min(replicas, -(-span * itemsize(spec.dtype) // rules.hybrid_part_bytes)))
            out.append(_Geometry("hybrid", n, span, layout.group_size, replicas, parts, cursor % replicas))
            cursor += parts
        elif isinstance(layout, MeshLayout):
            replicas = math.prod(layout.mesh[m] for m in layout.replicate_dims())
            boxes = layout.size // replicas
            if rules.version >= 4 and part_of_world(layout, world_size):
                # the tensor's own name picks its first writer: no other tensor counts
                out.append(_Geometry("mesh", n, 0, 1, replicas, boxes, zlib.crc32(spec.name.encode()) % replicas))
                continue
            out.append(_Geometry("mesh", n, 0, 1, replicas, boxes, cursor % replicas))
            cursor += boxes
        else:
            out.append(_Geometry("other", n))
    return out


def part_of_world(layout: object, world_size: int) -> bool:
    """A mesh spanning part of the world (a pipeline stage's, a ``dp_replicate`` slice):
    under rules 4 its tensors' writers depend on nothing else (not on the other tensors of
    the structure, which another stage does not know), and the balancer of replicated
    tensors leaves their bytes out. Ranks outside the mesh hold and write nothing of it."""
    return isinstance(layout, MeshLayout) and layout.size < world_size


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
    """Each sharded piece is written by the rank that holds it (a ``HybridShard`` piece in
    parts of about ``hybrid_part_bytes``, spread round its replicas); each replicated tensor once, by the least-loaded rank
    (largest first, ties by name then rank), so no rank writes much more than another."""
    if chunk_bytes < ALIGN:
        raise ValueError(f"chunk_bytes must be >= {ALIGN}, got {chunk_bytes}")
    return WritePlan(specs, world_size, PlanRules(chunk_bytes))


# -- the one global decision: who writes each replicated tensor --------------------------------
def sharded_loads(specs: Sequence[TensorSpec], world_size: int, rules: PlanRules | None = None) -> np.ndarray:
    """Bytes each rank writes for the non-replicated tensors, summed in closed form with
    numpy: a difference array for row splits (O(1) a tensor), O(G x parts) for a
    HybridShard tensor, O(W) only for a layout without closed form."""
    w = world_size
    rules = rules or PlanRules(CHUNK_BYTES_DEFAULT)
    diff = np.zeros(w + 1, dtype=np.int64)  # prefix-summed: spans held by a run of ranks
    loads = np.zeros(w, dtype=np.int64)
    for spec, geo in zip(specs, _geometries(specs, w, rules)):
        n, size = geo.n, itemsize(spec.dtype)
        if not n or geo.kind == "replicate" or (rules.version >= 4 and part_of_world(spec.layout, w)):
            continue
        if geo.kind == "rows":
            full, rest = divmod(n, geo.span)
            diff[0] += geo.span * size
            diff[full] -= geo.span * size
            if rest:
                loads[full] += rest * size
        elif geo.kind == "hybrid":
            pos = np.arange(geo.group, dtype=np.int64)
            piece = np.clip(n - pos * geo.span, 0, geo.span)  # elements held by each position
            j = np.arange(geo.parts + 1, dtype=np.int64)[:, None]
            bounds = j * piece[None, :] // geo.parts
            replica = (geo.first + pos[None, :] + j[:-1]) % geo.replicas
            np.add.at(loads, (replica * geo.group + pos[None, :]).ravel(), ((bounds[1:] - bounds[:-1]) * size).ravel())
        elif geo.kind == "mesh":
            np.add.at(loads, *_mesh_loads(spec.layout, spec.shape, geo.first, geo.replicas, size))
        else:
            for r in range(w):
                loads[r] += len(spec.layout.flat_range(spec.shape, w, r)) * size
    return loads + np.cumsum(diff)[:w]


@functools.lru_cache(maxsize=4096)
def _mesh_loads(layout: MeshLayout, shape: tuple, first: int, replicas: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(ranks, bytes each writes) of a MeshLayout tensor, in closed form over the mesh:
    each tensor dim's interval lengths broadcast over the mesh dims that shard it."""
    mesh = layout.mesh
    nbytes = np.full(mesh, size, dtype=np.int64)
    for d, n in enumerate(shape):
        dims = layout.shard_dims(d)
        lengths = np.zeros([mesh[m] for m in dims], dtype=np.int64)
        for c, (lo, hi) in _dim_intervals(layout, n, d)[0]:
            lengths[c] = hi - lo
        view = [mesh[m] if m in dims else 1 for m in range(len(mesh))]
        order = np.argsort(dims) if dims else []
        nbytes = nbytes * lengths.transpose(order).reshape(view) if dims else nbytes * n
    grid = np.indices(mesh)
    box = np.zeros(mesh, dtype=np.int64)
    replica = np.zeros(mesh, dtype=np.int64)
    for m, (kind, _d, _sf) in enumerate(layout.parsed):
        if kind == "R":
            replica = replica * mesh[m] + grid[m]
        else:
            box = box * mesh[m] + grid[m]
    writes = replica == (first + box) % replicas
    ranks = np.array(layout.rank_table(), dtype=np.int64)
    return ranks[writes.ravel()], nbytes.ravel()[writes.ravel()]


def _balance_replicated(specs: Sequence[TensorSpec], world_size: int, rules: PlanRules) -> dict[int, int]:
    replicated = [i for i, s in enumerate(specs) if isinstance(s.layout, Replicate) and s.numel]
    if not replicated:
        return {}
    loads = sharded_loads(specs, world_size, rules)
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
    "part_of_world", "piece_chunk_bytes", "sharded_loads",
]
