"""DTensor leaves (FSDP2, ``distribute_tensor``, ``get_state_dict``) as flexshard layouts.

A DTensor is turned, at the edge of the state walk, into what flexckpt already saves and
loads: this rank's local tensor, a flexshard layout and the global shape.

    1-D mesh, ``Shard(0)``                 -> ``Shard(0)`` (both split dim 0 as ``torch.chunk``:
                                             ``ceil(S0 / W)`` rows each, trailing ranks short or empty)
    1-D mesh, ``Replicate()``              -> ``Replicate()``
    2-D mesh, ``(Replicate(), Shard(0))``  -> ``HybridShard(group_size=mesh.size(1))`` (HSDP)
    2-D mesh, ``(Replicate(), Replicate())`` -> ``Replicate()``

Everything else (``Shard(d)`` for d > 0, ``_StridedShard``, ``Partial``, other meshes) is
refused here, on the calling thread of ``save()``/``load()``. The piece a rank holds is
decided by its mesh coordinate; the mapping is accepted only when that coordinate gives
the same piece as the layout does for the checkpointer's rank (a mesh that spans the
whole world, ranks numbered as FSDP2 numbers them). Nothing here communicates.
"""
from __future__ import annotations

import functools
import weakref
from typing import Any

import torch

import flexshard
from flexshard import Layout, Replicate, Shard

try:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Replicate as DReplicate
    from torch.distributed.tensor import Shard as DShard
except ImportError:  # a torch build without distributed: no DTensor can reach us
    DTensor = DReplicate = DShard = None  # type: ignore[assignment, misc]

SUPPORTED = (
    "1-D mesh with (Shard(0),) or (Replicate(),); 2-D (replicate, shard) mesh with "
    "(Replicate(), Shard(0)) or (Replicate(), Replicate()); the mesh must span every rank"
)


def is_dtensor(value: Any) -> bool:
    return DTensor is not None and isinstance(value, DTensor)


def dtensor_leaf(value: Any, name: str, rank: int, world_size: int) -> tuple[torch.Tensor, Layout, tuple[int, ...]]:
    """``(local tensor, layout, global shape)`` for the DTensor ``value`` named ``name``.

    The local tensor shares storage with the DTensor (loads write into it in place). This
    runs for every DTensor on every save: what depends only on the mesh is computed once
    per mesh, and the mapping once per (placements, shape, mesh, rank, world)."""
    local = value._local_tensor
    if local.requires_grad:  # to_local() would add an autograd node on parameters
        local = local.detach()
    shape = tuple(value.shape)
    mesh_shape, ranks, coordinate, where = _mesh_facts(value.device_mesh)
    try:
        layout, want = _mapping(mesh_shape, ranks, coordinate, tuple(value.placements), shape, rank, world_size)
    except ValueError as e:
        raise ValueError(f"cannot checkpoint DTensor {name!r} on {where} placements {tuple(value.placements)}: {e}") from None
    if local.numel() != want[1] - want[0]:
        raise ValueError(
            f"DTensor {name!r} on {where}: this rank's local tensor has {local.numel()} elements, but its mesh "
            f"coordinate gives it elements [{want[0]}, {want[1]}) of {list(shape)}"
        )
    return local, layout, shape


_MESHES: dict[int, tuple[Any, tuple]] = {}


def _mesh_facts(mesh: Any) -> tuple:
    """(mesh shape, sorted ranks, this rank's coordinate, description), once per mesh."""
    hit = _MESHES.get(id(mesh))
    if hit is not None and hit[0]() is mesh:
        return hit[1]
    ranks = mesh.mesh.flatten().tolist()
    names = f" dims {mesh.mesh_dim_names}" if mesh.mesh_dim_names else ""
    where = f"DeviceMesh({mesh.device_type!r}, shape {tuple(mesh.mesh.shape)}{names}, ranks {ranks})"
    coordinate = mesh.get_coordinate()
    facts = (tuple(mesh.mesh.shape), tuple(sorted(ranks)), None if coordinate is None else tuple(coordinate), where)
    _MESHES[id(mesh)] = (weakref.ref(mesh), facts)
    return facts


@functools.lru_cache(maxsize=65536)
def _mapping(mesh_shape: tuple, ranks: tuple, coordinate: tuple | None, placements: tuple, shape: tuple,
             rank: int, world_size: int) -> tuple[Layout, tuple[int, int]]:
    """The layout and this rank's element range; ValueError (without the tensor's name)
    when the DTensor cannot be mapped."""
    if ranks != tuple(range(world_size)):
        raise ValueError(f"the mesh does not span the checkpoint's world of {world_size} ranks; supported: {SUPPORTED}")
    if coordinate is None:
        raise ValueError(f"this rank is not in the mesh; supported: {SUPPORTED}")
    kinds = tuple(_kind(p) for p in placements)
    if all(k == "replicate" for k in kinds) and len(kinds) in (1, 2):
        layout: Layout = Replicate()
    elif kinds == ("shard",):
        layout = Shard(0)
    elif kinds == ("replicate", "shard"):
        hybrid = getattr(flexshard, "HybridShard", None)
        if hybrid is None:
            raise ValueError(f"HSDP needs flexshard.HybridShard, which this flexshard does not have yet; supported: {SUPPORTED}")
        layout = hybrid(mesh_shape[1])
    else:
        raise ValueError(f"this placement is not supported; supported: {SUPPORTED}")
    want = _piece_by_coordinate(placements, shape, mesh_shape, coordinate)
    got = layout.flat_range(shape, world_size, rank)
    if (got.start, got.stop) != want:
        raise ValueError(
            f"at mesh coordinate {coordinate} this rank holds elements [{want[0]}, {want[1]}) of {list(shape)}, but "
            f"{layout} gives checkpoint rank {rank} of {world_size} [{got.start}, {got.stop}); the mesh must number "
            f"ranks in order (torch.arange(world).view(mesh shape)), as init_device_mesh does"
        )
    return layout, want


def _kind(p: Any) -> str:
    # exact types: _StridedShard derives from Shard and must not pass for it
    if type(p) is DShard and p.dim == 0:
        return "shard"
    if type(p) is DReplicate:
        return "replicate"
    return "other"


def _piece_by_coordinate(placements: tuple, shape: tuple[int, ...], mesh_shape: tuple, coordinate: tuple) -> tuple[int, int]:
    """The flat element range a rank holds, from its mesh coordinate alone (torch.chunk
    split of dim 0 over the shard mesh dim)."""
    total = 1
    for s in shape:
        total *= s
    shard_dims = [i for i, p in enumerate(placements) if type(p) is DShard]
    if not shard_dims:
        return (0, total)
    i = shard_dims[0]
    parts, index = mesh_shape[i], coordinate[i]
    rows = shape[0] if shape else 1
    per_row = total // rows if rows else 0
    step = -(-rows // parts)
    first = min(index * step, rows)
    last = min(first + step, rows)
    return (first * per_row, last * per_row)
