"""Layouts: which elements of a global tensor each data-parallel rank holds.

Every layout maps (global shape, world size, rank) to one contiguous range of the
row-major flat index space ``[0, numel)``, possibly empty. Sharding layouts split along
dim 0 in whole rows (a 1-D tensor's rows are single elements; a 0-d tensor is one row
of one element), so a rank's piece is always a contiguous slab ``local.view(rows, ...)``.

Pure functions only: no processes, no I/O.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence, Union

from flexshard.box import Part, box_part, flat_part
from flexshard.ranges import FlatRange
from flexshard.world import ranks

Shape = tuple[int, ...]


def _check_world(world_size: int, rank: int) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, {world_size}), got {rank!r}")


def normalize_shape(shape: Sequence[int]) -> Shape:
    out = tuple(map(int, shape))
    if out and min(out) < 0:
        raise ValueError(f"shape dimensions must be >= 0, got {tuple(shape)}")
    return out


def numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


def row_count(shape: Shape) -> int:
    """Number of dim-0 rows; a 0-d tensor is one row of one element."""
    return shape[0] if shape else 1


def row_numel(shape: Shape) -> int:
    """Elements per dim-0 row."""
    return math.prod(shape[1:]) if shape else 1


def _rows_range(rows_per_rank: int, total_rows: int, shape: Shape, rank: int) -> FlatRange:
    first = min(rank * rows_per_rank, total_rows)
    last = min(first + rows_per_rank, total_rows)
    per_row = row_numel(shape)
    return FlatRange(first * per_row, last * per_row)


@dataclass(frozen=True)
class Replicate:
    """Every rank holds the whole tensor."""

    def flat_range(self, shape: Sequence[int], world_size: int, rank: int) -> FlatRange:
        _check_world(world_size, rank)
        return FlatRange(0, numel(normalize_shape(shape)))

    def to_json(self) -> dict:
        return {"kind": "replicate"}


@dataclass(frozen=True)
class Shard:
    """FSDP-style split of dim 0 into ``ceil(rows / world)``-row pieces; trailing ranks
    may be short or empty. Only ``dim=0`` exists: it is the baseline the other layouts
    improve on."""

    dim: int = 0

    def __post_init__(self) -> None:
        if self.dim != 0:
            raise ValueError(f"Shard(dim={self.dim!r}) is not supported: only Shard(0) exists")

    def rows_per_rank(self, shape: Sequence[int], world_size: int) -> int:
        return -(-row_count(normalize_shape(shape)) // world_size)

    def flat_range(self, shape: Sequence[int], world_size: int, rank: int) -> FlatRange:
        _check_world(world_size, rank)
        shape = normalize_shape(shape)
        return _rows_range(self.rows_per_rank(shape, world_size), row_count(shape), shape, rank)

    def to_json(self) -> dict:
        return {"kind": "shard", "dim": self.dim}


@dataclass(frozen=True)
class Owned:
    """One rank (``owner``) holds the whole tensor; every other rank holds nothing."""

    owner: int

    def __post_init__(self) -> None:
        if not isinstance(self.owner, int) or isinstance(self.owner, bool) or self.owner < 0:
            raise ValueError(f"Owned(owner=...) needs an int >= 0, got {self.owner!r}")

    def flat_range(self, shape: Sequence[int], world_size: int, rank: int) -> FlatRange:
        _check_world(world_size, rank)
        if self.owner >= world_size:
            raise ValueError(
                f"Owned(owner={self.owner}) does not exist in a world of {ranks(world_size)}; "
                f"recompute owners for this world with flexshard.assign_owners"
            )
        n = numel(normalize_shape(shape))
        return FlatRange(0, n) if rank == self.owner else FlatRange(0, 0)

    def to_json(self) -> dict:
        return {"kind": "owned", "owner": self.owner}


@dataclass(frozen=True)
class BlockShard:
    """Like ``Shard(0)`` but every rank receives whole blocks of ``block_size`` rows
    (for a 1-D tensor: ``block_size`` elements), so no block is ever split between ranks.
    Only the last block may be short."""

    block_size: int = 32

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"BlockShard(block_size=...) needs an int >= 1, got {self.block_size!r}")

    def blocks_per_rank(self, shape: Sequence[int], world_size: int) -> int:
        blocks = -(-row_count(normalize_shape(shape)) // self.block_size)
        return -(-blocks // world_size)

    def rows_per_rank(self, shape: Sequence[int], world_size: int) -> int:
        return self.blocks_per_rank(shape, world_size) * self.block_size

    def flat_range(self, shape: Sequence[int], world_size: int, rank: int) -> FlatRange:
        _check_world(world_size, rank)
        shape = normalize_shape(shape)
        return _rows_range(self.rows_per_rank(shape, world_size), row_count(shape), shape, rank)

    def to_json(self) -> dict:
        return {"kind": "block_shard", "block_size": self.block_size}


@dataclass(frozen=True)
class HybridShard:
    """Sharded within groups, replicated across them (FSDP2's HSDP mesh ``(replicate,
    shard)``): ranks form groups of ``group_size`` consecutive ranks, and rank ``r`` holds
    what ``Shard(0)`` (``block_size`` None) or ``BlockShard(block_size)`` gives rank
    ``r % group_size`` in a world of ``group_size``. Every group holds a whole copy."""

    group_size: int
    block_size: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.group_size, int) or isinstance(self.group_size, bool) or self.group_size < 1:
            raise ValueError(f"HybridShard(group_size=...) needs an int >= 1, got {self.group_size!r}")
        if self.block_size is not None and (
            not isinstance(self.block_size, int) or isinstance(self.block_size, bool) or self.block_size < 1
        ):
            raise ValueError(f"HybridShard(block_size=...) needs None or an int >= 1, got {self.block_size!r}")

    @property
    def inner(self) -> "Shard | BlockShard":
        """The layout each group applies among its ``group_size`` ranks."""
        return Shard(0) if self.block_size is None else BlockShard(self.block_size)

    def groups(self, world_size: int) -> int:
        """How many replicas (groups) a world of ``world_size`` ranks has."""
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        if world_size % self.group_size:
            raise ValueError(
                f"HybridShard(group_size={self.group_size}) needs a world size divisible by the group size, "
                f"got world_size={world_size}; use a group_size that divides {world_size} (e.g. the GPUs per node)"
            )
        return world_size // self.group_size

    def flat_range(self, shape: Sequence[int], world_size: int, rank: int) -> FlatRange:
        _check_world(world_size, rank)
        self.groups(world_size)
        return self.inner.flat_range(shape, self.group_size, rank % self.group_size)

    def rows_per_rank(self, shape: Sequence[int], world_size: int) -> int:
        self.groups(world_size)
        return self.inner.rows_per_rank(shape, self.group_size)

    def to_json(self) -> dict:
        return {"kind": "hybrid_shard", "group_size": self.group_size, "block_size": self.block_size}


from flexshard.mesh_layout import MeshLayout  # noqa: E402 - a layout whose pieces are n-D boxes

Layout = Union[Replicate, Shard, Owned, BlockShard, HybridShard, MeshLayout]
LAYOUT_TYPES = (Replicate, Shard, Owned, BlockShard, HybridShard, MeshLayout)
_CACHED_LAYOUTS = frozenset(LAYOUT_TYPES)  # hashable, compared by value, immutable


_PARTS: dict[tuple, Part] = {}  # part_of's answers, by (layout, shape, world size, rank)
_PARTS_KEPT = 1 << 14


def part_of(layout: Layout, shape: Sequence[int], world_size: int, rank: int) -> Part:
    """The piece ``rank`` holds, in the one geometry of pieces (:mod:`flexshard.box`): a
    ``MeshLayout``'s box, or a flat range of the whole tensor for every other layout.

    A pure function of its arguments, and a load asks it once a tensor, most of which
    share a few (layout, shape) pairs: answers for a known layout type, a tuple shape and
    int world and rank are kept (bounded), so a repeated question is a dict lookup."""
    if type(layout) in _CACHED_LAYOUTS and isinstance(shape, tuple) and type(world_size) is int and type(rank) is int:
        key = (layout, shape, world_size, rank)
        try:
            part = _PARTS.get(key)
        except TypeError:  # an unhashable dimension: the computation says what is wrong with it
            return _part_of(layout, shape, world_size, rank)
        if part is None:
            part = _part_of(layout, shape, world_size, rank)  # raises for a bad one: nothing kept
            if len(_PARTS) >= _PARTS_KEPT:
                _PARTS.clear()
            _PARTS[key] = part
        return part
    return _part_of(layout, shape, world_size, rank)


def _part_of(layout: Layout, shape: Sequence[int], world_size: int, rank: int) -> Part:
    box = getattr(layout, "box", None)
    if box is not None:
        return box_part(box(shape, world_size, rank))
    r = layout.flat_range(shape, world_size, rank)
    return flat_part(normalize_shape(shape), r.start, r.stop)


_FROM_JSON: dict[tuple, Layout] = {}  # layouts read back, by their JSON object's items
_FROM_JSON_KEPT = 4096
_SCALAR_TYPES = frozenset((str, int, type(None)))


def layout_from_json(obj: object) -> Layout:
    """Rebuild a layout from :meth:`to_json` output; rejects anything else (untrusted input).

    A manifest holds one layout a tensor and few distinct ones: an object whose values are
    all exactly str, int or null (so that equal items mean identical JSON: no bool for an
    int) is read once and its layout, immutable, kept for the next equal object."""
    if type(obj) is dict and _SCALAR_TYPES.issuperset(map(type, obj.values())):
        key = tuple(obj.items())
        layout = _FROM_JSON.get(key)
        if layout is None:
            layout = _layout_from_json(obj)  # raises for a bad one: nothing kept
            if len(_FROM_JSON) >= _FROM_JSON_KEPT:
                _FROM_JSON.clear()
            _FROM_JSON[key] = layout
        return layout
    return _layout_from_json(obj)


def _layout_from_json(obj: object) -> Layout:
    if not isinstance(obj, dict) or not isinstance(obj.get("kind"), str):
        raise ValueError(f"a layout must be an object with a 'kind', got {obj!r}")
    kind = obj["kind"]
    if kind == "mesh":
        from flexshard.mesh_layout import mesh_layout_from_json

        return mesh_layout_from_json(obj)
    extra = set(obj) - {"kind", "dim", "owner", "block_size", "group_size"}
    if extra:
        raise ValueError(f"unknown layout fields {sorted(extra)} in {obj!r}")
    if kind == "replicate":
        return Replicate()
    if kind == "shard":
        return Shard(_json_int(obj, "dim"))
    if kind == "owned":
        return Owned(_json_int(obj, "owner"))
    if kind == "block_shard":
        return BlockShard(_json_int(obj, "block_size"))
    if kind == "hybrid_shard":
        block = obj.get("block_size")
        return HybridShard(_json_int(obj, "group_size"), None if block is None else _json_int(obj, "block_size"))
    raise ValueError(
        f"unknown layout kind {kind!r}; expected replicate, shard, owned, block_shard, hybrid_shard or mesh"
    )


def _json_int(obj: dict, key: str) -> int:
    value = obj.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"layout field {key!r} must be an int, got {value!r}")
    return value


def local_shape(layout: Layout, shape: Sequence[int], world_size: int, rank: int) -> Shape:
    """Shape of this rank's piece: whole-tensor layouts keep the global shape (or are
    empty rows), row layouts keep every dimension but the first, a mesh layout's is its box."""
    shape = normalize_shape(shape)
    if isinstance(layout, MeshLayout):
        return layout.box(shape, world_size, rank).sizes
    r = layout.flat_range(shape, world_size, rank)
    if isinstance(layout, (Replicate, Owned)) and len(r) == numel(shape):
        return shape
    if not shape:
        return (len(r),) if len(r) == 0 else shape
    per_row = row_numel(shape)
    rows = len(r) // per_row if per_row else _rows_when_rows_are_empty(layout, shape, world_size, rank)
    return (rows, *shape[1:])


def _rows_when_rows_are_empty(layout: Layout, shape: Shape, world_size: int, rank: int) -> int:
    # Rows of zero elements (a shape like (10, 0)): the flat range cannot tell rows apart,
    # so count them from the row split itself.
    if isinstance(layout, HybridShard):
        return _rows_when_rows_are_empty(layout.inner, shape, layout.group_size, rank % layout.group_size)
    if isinstance(layout, (Shard, BlockShard)):
        per = layout.rows_per_rank(shape, world_size)
        first = min(rank * per, shape[0])
        return min(first + per, shape[0]) - first
    if isinstance(layout, Owned):
        return shape[0] if rank == layout.owner else 0
    return shape[0]


def holders(layout: Layout, shape: Sequence[int], world_size: int) -> list[int]:
    """Ranks whose piece is non-empty (for Replicate: every rank)."""
    return [r for r in range(world_size) if len(part_of(layout, shape, world_size, r)) > 0]
