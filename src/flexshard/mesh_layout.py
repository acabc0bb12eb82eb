"""``MeshLayout``: a DTensor placement on a device mesh as a layout whose pieces are boxes.

The mesh is a shape (1 to 3 dims in practice) and, when it does not number ranks
``0..W-1`` in row-major order, its rank table. Each mesh dim carries a placement:

    ``R``          replicate along this mesh dim
    ``S<d>``       shard tensor dim ``d`` (``torch.chunk`` rule: ``ceil(n / k)``-element
                   pieces, trailing ones short or empty)
    ``SS<d>:<sf>`` ``_StridedShard(d, split_factor=sf)``: split dim ``d`` into ``sf`` pieces,
                   each of those into mesh-size pieces, and keep this coordinate's piece of
                   each (what FSDP2 puts in front of a tensor-parallel ``Shard(d)``)

Placements apply left to right, as DTensor applies them, each to what the previous ones
left along the same tensor dim. A rank's piece must come out as one box (the tuples
torchtitan builds all do, uneven sizes included); a placement that leaves a rank a
strided set of rows (a lone ``_StridedShard`` from a view op) is refused. Pure functions.
"""
from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from typing import Sequence

from flexshard.box import Box
from flexshard.ranges import FlatRange
from flexshard.world import ranks

_PLACEMENT = re.compile(r"^(R|S(\d+)|SS(\d+):(\d+))$")
MAX_MESH_DIMS = 8
MAX_SPLIT_FACTOR = 1 << 12  # torchtitan's are TP or EP degrees; a manifest's bounds the work of a lookup


def parse_placement(p: str) -> tuple[str, int, int]:
    """``("R", -1, 1)``, ``("S", dim, 1)`` or ``("SS", dim, split_factor)``."""
    m = _PLACEMENT.match(p) if isinstance(p, str) else None
    if m is None:
        raise ValueError(f"placement {p!r} is not R, S<dim> or SS<dim>:<split_factor> (e.g. S0, SS0:2)")
    if m.group(2) is not None:
        return ("S", int(m.group(2)), 1)
    if m.group(3) is not None:
        sf = int(m.group(4))
        if not 1 <= sf <= MAX_SPLIT_FACTOR:
            raise ValueError(f"placement {p!r}: split factor must be in [1, {MAX_SPLIT_FACTOR}]")
        return ("SS", int(m.group(3)), sf)
    return ("R", -1, 1)


def _chunk(n: int, k: int, i: int) -> tuple[int, int]:
    """``[lo, hi)`` of piece ``i`` when ``n`` elements are cut into ``k`` by torch.chunk."""
    c = -(-n // k) if n else 0
    lo = min(i * c, n)
    return lo, min(lo + c, n)


def _take(intervals: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    """Positions ``[lo, hi)`` of the concatenation of ``intervals``."""
    out, pos = [], 0
    for a, b in intervals:
        n = b - a
        s, e = max(lo, pos), min(hi, pos + n)
        if s < e:
            out.append((a + s - pos, a + e - pos))
        pos += n
    return out


def _apply(held: list[tuple[int, int]], kind: str, k: int, i: int, sf: int) -> list[tuple[int, int]]:
    """What coordinate ``i`` of a mesh dim of size ``k`` keeps of ``held`` (a list of
    global intervals, in local order) under placement ``kind``."""
    total = sum(b - a for a, b in held)
    if kind == "S":
        return _take(held, *_chunk(total, k, i))
    out = []
    for j in range(sf):
        lo, hi = _chunk(total, sf, j)
        a, b = _chunk(hi - lo, k, i)
        out += _take(held, lo + a, lo + b)
    return out


def _merged(held: list[tuple[int, int]]) -> tuple[int, int] | None:
    """``held`` as one interval (``(0, 0)`` when empty), or None when it is not one."""
    merged: list[tuple[int, int]] = []
    for a, b in held:
        if b <= a:
            continue
        if merged and merged[-1][1] == a:
            merged[-1] = (merged[-1][0], b)
        else:
            merged.append((a, b))
    if len(merged) > 1:
        return None
    return merged[0] if merged else (0, 0)


@functools.lru_cache(maxsize=1 << 16)
def _interval(size: int, chain: tuple[tuple[str, int, int, int], ...]) -> tuple[int, int] | None:
    """The global ``[lo, hi)`` a coordinate holds along one tensor dim of ``size``, given the
    ``(kind, mesh size, coordinate, split factor)`` of the mesh dims that shard it, in mesh
    order; None when it is not one interval."""
    held = [(0, size)]
    for kind, k, i, sf in chain:
        held = _apply(held, kind, k, i, sf)
    return _merged(held)


def _all_intervals(size: int, chain: tuple[tuple[str, int, int], ...]) -> list[tuple[tuple[int, ...], tuple[int, int] | None]]:
    """``(coordinates, interval or None)`` for every coordinate of the ``(kind, mesh size,
    split factor)`` chain, row-major; each prefix of the chain is applied once."""
    level: list[tuple[tuple[int, ...], list[tuple[int, int]]]] = [((), [(0, size)])]
    for kind, k, sf in chain:
        level = [(c + (i,), _apply(held, kind, k, i, sf)) for c, held in level for i in range(k)]
    return [(c, _merged(held)) for c, held in level]


@dataclass(frozen=True)
class MeshLayout:
    """A placement per mesh dim (see the module doc) on a mesh of shape ``mesh``. Its rank
    table, row-major, is ``offset + ranks[i]`` (``ranks`` None: ``offset + i``); a mesh may
    span part of the world (a pipeline stage: ``offset`` = its first rank), and a rank
    outside it holds nothing."""

    mesh: tuple[int, ...]
    placements: tuple[str, ...]
    ranks: tuple[int, ...] | None = None
    offset: int = 0

    def __post_init__(self) -> None:
        mesh, placements = tuple(self.mesh), tuple(self.placements)
        object.__setattr__(self, "mesh", mesh)
        object.__setattr__(self, "placements", placements)
        if not 1 <= len(mesh) <= MAX_MESH_DIMS or not all(isinstance(k, int) and not isinstance(k, bool) and k >= 1 for k in mesh):
            raise ValueError(f"MeshLayout mesh must be 1 to {MAX_MESH_DIMS} sizes >= 1, got {mesh!r}")
        if len(placements) != len(mesh):
            raise ValueError(f"MeshLayout needs one placement per mesh dim: mesh {mesh}, placements {placements}")
        for p in placements:
            parse_placement(p)
        if not isinstance(self.offset, int) or isinstance(self.offset, bool) or self.offset < 0:
            raise ValueError(f"MeshLayout offset must be an int >= 0, got {self.offset!r}")
        if self.ranks is not None:
            ranks = tuple(self.ranks)
            if ranks and min(ranks) > 0:  # a table of later ranks: its first rank is the offset
                object.__setattr__(self, "offset", self.offset + min(ranks))
                ranks = tuple(r - min(ranks) for r in ranks)
            object.__setattr__(self, "ranks", None if ranks == tuple(range(len(ranks))) else ranks)
            if len(ranks) != math.prod(mesh) or len(set(ranks)) != len(ranks) or not all(
                    isinstance(r, int) and r >= 0 for r in ranks):
                raise ValueError(f"MeshLayout rank table must hold {math.prod(mesh)} distinct ranks, got {ranks[:16]!r}")

    @property
    def size(self) -> int:
        return math.prod(self.mesh)

    @functools.cached_property
    def parsed(self) -> tuple[tuple[str, int, int], ...]:
        return tuple(parse_placement(p) for p in self.placements)

    @functools.cached_property
    def _position(self) -> dict[int, int] | None:
        return None if self.ranks is None else {r: i for i, r in enumerate(self.ranks)}

    @property
    def last_rank(self) -> int:
        return self.offset + (self.size if self.ranks is None else max(self.ranks) + 1) - 1

    def rank_table(self) -> list[int]:
        return [self.offset + r for r in (range(self.size) if self.ranks is None else self.ranks)]

    def check(self, shape: Sequence[int], world_size: int) -> None:
        if self.last_rank >= world_size:
            raise ValueError(f"{self} reaches rank {self.last_rank}, the world has {ranks(world_size)}; give a mesh "
                             f"whose rank table lies inside the world (sizes that multiply to {world_size})")
        for kind, dim, _sf in self.parsed:
            if kind != "R" and dim >= len(shape):
                raise ValueError(f"{self} shards dim {dim} of a tensor of shape {list(shape)}")

    def coordinate(self, rank: int) -> tuple[int, ...] | None:
        """This rank's position on the mesh, from the rank table; None outside the mesh."""
        pos = rank - self.offset
        pos = (pos if 0 <= pos < self.size else None) if self._position is None else self._position.get(pos)
        if pos is None:
            return None
        out = []
        for k in reversed(self.mesh):
            pos, c = divmod(pos, k)
            out.append(c)
        return tuple(reversed(out))

    def rank_at(self, coordinate: Sequence[int]) -> int:
        pos = 0
        for k, c in zip(self.mesh, coordinate):
            pos = pos * k + c
        return self.offset + (pos if self.ranks is None else self.ranks[pos])

    def shard_dims(self, tensor_dim: int) -> tuple[int, ...]:
        """The mesh dims that shard ``tensor_dim``, in mesh order."""
        return tuple(m for m, (kind, dim, _sf) in enumerate(self.parsed) if kind != "R" and dim == tensor_dim)

    def replicate_dims(self) -> tuple[int, ...]:
        return tuple(m for m, (kind, _dim, _sf) in enumerate(self.parsed) if kind == "R")

    def interval(self, size: int, tensor_dim: int, coordinate: Sequence[int]) -> tuple[int, int]:
        """What ``coordinate`` holds along ``tensor_dim`` (of ``size``); ValueError if the
        placements leave it a strided set rather than one interval."""
        chain = tuple((self.parsed[m][0], self.mesh[m], coordinate[m], self.parsed[m][2]) for m in self.shard_dims(tensor_dim))
        got = _interval(size, chain)
        if got is None:
            raise ValueError(
                f"{self}: mesh coordinate {tuple(coordinate)} holds a strided set of indices along dim {tensor_dim} "
                f"(size {size}), not one box; redistribute the DTensor to Shard/Replicate placements before saving"
            )
        return got

    def dim_intervals(self, size: int, tensor_dim: int) -> list[tuple[tuple[int, ...], tuple[int, int]]]:
        """Every ``(coordinates of the mesh dims sharding tensor_dim, interval)`` along it,
        in row-major order of those coordinates; ValueError as :meth:`interval`."""
        chain = tuple((self.parsed[m][0], self.mesh[m], self.parsed[m][2]) for m in self.shard_dims(tensor_dim))
        out = _all_intervals(size, chain)
        for c, iv in out:
            if iv is None:
                coord = [0] * len(self.mesh)
                for m, x in zip(self.shard_dims(tensor_dim), c):
                    coord[m] = x
                self.interval(size, tensor_dim, coord)  # raises, naming the coordinate
        return out  # type: ignore[return-value]

    def box(self, shape: Sequence[int], world_size: int, rank: int) -> Box:
        shape = tuple(int(s) for s in shape)
        self.check(shape, world_size)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")
        coord = self.coordinate(rank)
        if coord is None:  # outside the mesh: nothing
            return Box((0,) * len(shape), (0,) * len(shape))
        spans = [self.interval(n, d, coord) for d, n in enumerate(shape)]
        return Box(tuple(a for a, _ in spans), tuple(b - a for a, b in spans))

    def flat_range(self, shape: Sequence[int], world_size: int, rank: int) -> FlatRange:
        """The box as a flat range, when it is one (a dim-0 slab, the whole tensor or
        nothing); ValueError for a true n-D box (use ``flexshard.part_of``)."""
        box = self.box(shape, world_size, rank)
        shape = tuple(shape)
        n = box.numel
        if n == 0:
            return FlatRange(0, 0)
        k = 0
        while k < len(shape) and box.sizes[k] == 1:
            k += 1
        if k < len(shape) and box.sizes[k + 1:] != shape[k + 1:]:
            raise ValueError(f"{self} gives rank {rank} the box {box} of {list(shape)}, which is not a flat range")
        strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
        start = sum(o * s for o, s in zip(box.offsets, strides))
        return FlatRange(start, start + n)

    def to_json(self) -> dict:
        out = {"kind": "mesh", "mesh": list(self.mesh), "placements": list(self.placements),
               "ranks": None if self.ranks is None else list(self.ranks)}
        if self.offset:
            out["offset"] = self.offset
        return out

    def __str__(self) -> str:
        where = ("" if self.ranks is None else ", ranks=...") + (f", offset={self.offset}" if self.offset else "")
        return f"MeshLayout(mesh={self.mesh}, placements=({', '.join(self.placements)}){where})"


def mesh_layout_from_json(obj: dict) -> MeshLayout:
    extra = set(obj) - {"kind", "mesh", "placements", "ranks", "offset"}
    if extra:
        raise ValueError(f"unknown mesh layout fields {sorted(extra)}")
    mesh, placements, ranks = obj.get("mesh"), obj.get("placements"), obj.get("ranks")
    if not isinstance(mesh, list) or not isinstance(placements, list) or not (ranks is None or isinstance(ranks, list)):
        raise ValueError("a mesh layout needs lists 'mesh' and 'placements' and 'ranks' (a list or null)")
    if not all(type(k) is int for k in mesh) or not all(type(p) is str for p in placements):
        raise ValueError("a mesh layout's mesh holds ints and its placements strings")
    if ranks is not None and (len(ranks) > 1 << 20 or not all(type(r) is int for r in ranks)):
        raise ValueError("a mesh layout's rank table holds at most 2^20 ints")
    offset = obj.get("offset", 0)
    if type(offset) is not int or not 0 <= offset < 1 << 20:
        raise ValueError(f"a mesh layout's offset must be an int in [0, 2^20), got {offset!r}")
    return MeshLayout(tuple(mesh), tuple(placements), None if ranks is None else tuple(ranks), offset)


__all__ = ["MeshLayout", "mesh_layout_from_json", "parse_placement"]
