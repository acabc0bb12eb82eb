"""DTensor leaves (FSDP2, tensor parallelism, ``distribute_tensor``, ``get_state_dict``) as
flexshard layouts.

A DTensor is turned, at the edge of the state walk, into what flexckpt already saves and
loads: this rank's local tensor, a flexshard layout and the global shape.

    1-D mesh, ``Shard(0)``                 -> ``Shard(0)`` (both split dim 0 as ``torch.chunk``:
                                             ``ceil(S0 / W)`` rows each, trailing ranks short or empty)
    1-D mesh, ``Replicate()``              -> ``Replicate()``
    2-D mesh, ``(Replicate(), Shard(0))``  -> ``HybridShard(group_size=mesh.size(1))`` (HSDP)
    all ``Replicate()``                    -> ``Replicate()``
    anything else of ``Shard(d)``, ``_StridedShard(d, sf)`` and ``Replicate()`` on a mesh of
    any number of dims -> ``MeshLayout(mesh shape, placements, rank table)``: each rank's
    piece is an n-D box (TP ``Shard(1)``, FSDP x TP ``(_StridedShard(0, sf), Shard(0))``)

A mesh may span part of the world (a pipeline stage's, a ``dp_replicate`` slice) and each
parameter may have a mesh of its own (experts on ``(efsdp, ep)``, the rest on the dp
mesh): its rank table becomes the layout's (``MeshLayout`` with ``offset``/``ranks``),
ranks outside it hold nothing of the tensor, and a rank's position is read from that table
(``DeviceMesh.mesh``, a local tensor: no collective). The Replicate/Shard/HybridShard
shortcuts above apply only to meshes numbering the whole world in order.

``Partial`` is refused (redistribute first), as is a placement that leaves a rank a
strided set of rows (a lone ``_StridedShard`` from a view op) and a rank table reaching
past the checkpoint's world; on the calling thread of ``save()``/``load()``. Nothing here
communicates.
"""
from __future__ import annotations

import functools
import sys
import weakref
from typing import Any

import torch

import flexshard
from flexshard import Layout, MeshLayout, Replicate, Shard

_TYPES: tuple | None = None  # (DTensor, Replicate, Shard, _StridedShard, Partial) once looked up


def _types() -> tuple:
    """torch's DTensor classes, imported on first need (None each on a torch build without
    distributed: no DTensor can reach us there)."""
    global _TYPES
    if _TYPES is None:
        try:
            from torch.distributed.tensor import DTensor
            from torch.distributed.tensor import Partial as DPartial
            from torch.distributed.tensor import Replicate as DReplicate
            from torch.distributed.tensor import Shard as DShard
            from torch.distributed.tensor.placement_types import _StridedShard as DStrided
        except ImportError:
            DTensor = DReplicate = DShard = DStrided = DPartial = None  # type: ignore[assignment, misc]
        _TYPES = (DTensor, DReplicate, DShard, DStrided, DPartial)
    return _TYPES


def dtensor_type() -> Any:
    """DTensor's class, or None while ``torch.distributed.tensor`` is not imported: a DTensor
    cannot exist before its module is, and importing it here (it pulls in sympy, seconds of
    CPU) would cost every process that imports flexckpt, DTensors or not."""
    if _TYPES is None and "torch.distributed.tensor" not in sys.modules:
        return None
    return _types()[0]


SUPPORTED = (
    "Shard(d), _StridedShard(d, sf) and Replicate() on a mesh of up to 3 dims whose ranks lie in the "
    "checkpoint's world (all of it or part: a pipeline stage), each rank's piece one box"
)


def is_dtensor(value: Any) -> bool:
    dtensor = dtensor_type()
    return dtensor is not None and isinstance(value, dtensor)


def dtensor_leaf(value: Any, name: str, rank: int, world_size: int) -> tuple[torch.Tensor, Layout, tuple[int, ...]]:
    """``(local tensor, layout, global shape)`` for the DTensor ``value`` named ``name``.

    The local tensor shares storage with the DTensor (loads write into it in place). This
    runs for every DTensor on every save: what depends only on the mesh is computed once
    per mesh, the mapping once per (placements, shape, mesh, rank, world), and a DTensor
    seen before (a parameter, an optimizer moment: the same objects every save) with the
    same spec, local tensor and shapes gets its answer back at once."""
    local = value._local_tensor
    hit = _LEAVES.get(id(value))
    if (hit is not None and hit[0]() is value and hit[1] is value._spec and hit[2] is local
            and hit[3] == (rank, world_size) and local.shape == hit[5]):
        layout, shape = hit[4]
        return (local.detach() if local.requires_grad else local), layout, shape
    source = local
    if local.requires_grad:  # to_local() would add an autograd node on parameters
        local = local.detach()
    shape = tuple(value.shape)
    mesh_shape, table_id, coordinate, where = _mesh_facts(value.device_mesh)
    try:
        layout, want = _mapping(mesh_shape, table_id, coordinate, tuple(value.placements), shape, rank, world_size)
    except ValueError as e:
        raise ValueError(f"cannot checkpoint DTensor {name!r} on {where} placements {tuple(value.placements)}: {e}") from None
    if local.numel() == 0 and tuple(local.shape) != want and 0 in want:
        # an empty piece, of whatever shape torch gives it: a rank outside the tensor's mesh, or
        # one whose experts ran out under Shard(0) on ep before FSDP2's Shard(1) (it hands [0, 0, 8])
        local = local.reshape(want)
    if tuple(local.shape) != want:
        raise ValueError(
            f"DTensor {name!r} on {where} placements {tuple(value.placements)}: this rank's local tensor has shape "
            f"{list(local.shape)}, but its mesh coordinate gives it a piece of shape {list(want)} of {list(shape)}"
        )
    if local.shape == source.shape:  # not an empty piece reshaped (left to this path each time)
        key = id(value)
        _LEAVES[key] = (weakref.ref(value, lambda _ref: _LEAVES.pop(key, None)), value._spec, source,
                        (rank, world_size), (layout, shape), source.shape)
    return local, layout, shape


_LEAVES: dict[int, tuple] = {}  # id of a DTensor -> (weakref, spec, local tensor, world, answer, local shape)


_MESHES: dict[int, tuple[Any, tuple]] = {}
_TABLES: list[tuple[int, ...]] = []  # every rank table seen, by id (a job has a handful)
_TABLE_IDS: dict[tuple[int, ...], int] = {}


def _mesh_facts(mesh: Any) -> tuple:
    """(mesh shape, id of its rank table in row-major order, this rank's coordinate,
    description), once per mesh. The table goes by a small id: it has a rank per entry, and
    the mapping's cache would hash it for every DTensor on every save."""
    hit = _MESHES.get(id(mesh))
    if hit is not None and hit[0]() is mesh:
        return hit[1]
    ranks = mesh.mesh.flatten().tolist()
    names = f" dims {mesh.mesh_dim_names}" if mesh.mesh_dim_names else ""
    where = f"DeviceMesh({mesh.device_type!r}, shape {tuple(mesh.mesh.shape)}{names}, ranks {ranks[:16]}{' ...' if len(ranks) > 16 else ''})"
    coordinate = mesh.get_coordinate()
    table = tuple(ranks)
    table_id = _TABLE_IDS.get(table)
    if table_id is None:
        table_id = _TABLE_IDS[table] = len(_TABLES)
        _TABLES.append(table)
    facts = (tuple(mesh.mesh.shape), table_id, None if coordinate is None else tuple(coordinate), where)
    _MESHES[id(mesh)] = (weakref.ref(mesh), facts)
    return facts


@functools.lru_cache(maxsize=65536)
def _mapping(mesh_shape: tuple, table_id: int, coordinate: tuple | None, placements: tuple, shape: tuple,
             rank: int, world_size: int) -> tuple[Layout, tuple[int, ...]]:
    """The layout and this rank's local shape; ValueError (without the tensor's name) when
    the DTensor cannot be mapped."""
    table = _TABLES[table_id]
    codes = tuple(_code(p) for p in placements)
    if not all(0 <= r < world_size for r in table):
        raise ValueError(f"the mesh's rank table reaches rank {max(table)}, outside the checkpoint's world of "
                         f"{flexshard.world.ranks(world_size)}; supported: {SUPPORTED}")
    mesh_layout = MeshLayout(mesh_shape, codes, table)
    if mesh_layout.coordinate(rank) != coordinate:
        where = "is not in the mesh" if coordinate is None else f"is at {coordinate}"
        raise ValueError(f"the mesh's rank table puts rank {rank} at {mesh_layout.coordinate(rank)}, but the mesh "
                         f"says this rank {where}; the checkpointer's rank must be the process group's rank")
    box = mesh_layout.box(shape, world_size, rank)
    layout: Layout = mesh_layout
    in_order = table == tuple(range(world_size))  # the whole world, in order: flexshard's own layouts
    if in_order and all(c == "R" for c in codes):
        layout = Replicate()
    elif in_order and codes == ("S0",):
        layout = Shard(0)
    elif in_order and codes == ("R", "S0"):
        layout = flexshard.HybridShard(mesh_shape[1])
    if layout is not mesh_layout and _nonempty(layout.flat_range(shape, world_size, rank)) != _nonempty(
            mesh_layout.flat_range(shape, world_size, rank)):
        raise AssertionError(f"{layout} disagrees with the mesh's own piece {box}")  # a bug here, not the caller's
    return layout, box.sizes


def _nonempty(r: Any) -> tuple[int, int]:
    return (r.start, r.stop) if r.stop > r.start else (0, 0)


def _code(p: Any) -> str:
    """A placement's code in ``MeshLayout`` (exact types: _StridedShard derives from Shard)."""
    _, DReplicate, DShard, DStrided, DPartial = _types()
    if type(p) is DReplicate:
        return "R"
    if type(p) is DShard:
        return f"S{p.dim}"
    if DStrided is not None and type(p) is DStrided:
        return f"SS{p.dim}:{int(p.split_factor)}"
    if DPartial is not None and isinstance(p, DPartial):
        raise ValueError(
            f"{p} holds partial sums, not a piece of the tensor; redistribute it first "
            f"(dt.redistribute(mesh, [Replicate() for each Partial]))"
        )
    raise ValueError(f"placement {p!r} is not supported; supported: {SUPPORTED}")
