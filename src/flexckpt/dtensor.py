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

    The local tensor shares storage with the DTensor (loads write into it in place)."""
    mesh, placements = value.device_mesh, tuple(value.placements)
    shape = tuple(value.shape)
    layout = _layout(name, mesh, placements, world_size)
    local = value._local_tensor.detach()  # to_local() would add an autograd node on parameters
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ValueError(f"{name!r}: this rank is not in the DTensor's mesh {_describe(mesh, placements)}; {SUPPORTED}")
    want = _piece_by_coordinate(placements, shape, mesh, coordinate)
    got = layout.flat_range(shape, world_size, rank)
    if (got.start, got.stop) != want or local.numel() != want[1] - want[0]:
        raise ValueError(
            f"{name!r}: at mesh coordinate {tuple(coordinate)} this rank holds elements [{want[0]}, {want[1]}) "
            f"({local.numel()} local) of {list(shape)}, but {layout} gives checkpoint rank {rank} of {world_size} "
            f"[{got.start}, {got.stop}); the mesh {_describe(mesh, placements)} must number ranks in order "
            f"(torch.arange(world).view(mesh shape)), as init_device_mesh does"
        )
    return local, layout, shape


def _describe(mesh: Any, placements: tuple) -> str:
    names = f" dims {mesh.mesh_dim_names}" if mesh.mesh_dim_names else ""
    return f"DeviceMesh({mesh.device_type!r}, shape {tuple(mesh.mesh.shape)}{names}, ranks {mesh.mesh.flatten().tolist()}) placements {placements}"


def _refuse(name: str, mesh: Any, placements: tuple, why: str) -> ValueError:
    return ValueError(f"cannot checkpoint DTensor {name!r} on {_describe(mesh, placements)}: {why}; supported: {SUPPORTED}")


def _layout(name: str, mesh: Any, placements: tuple, world_size: int) -> Layout:
    ranks = sorted(mesh.mesh.flatten().tolist())
    if ranks != list(range(world_size)):
        raise _refuse(name, mesh, placements, f"the mesh does not span the checkpoint's world of {world_size} ranks")
    kinds = tuple(_kind(p) for p in placements)
    if all(k == "replicate" for k in kinds) and len(kinds) in (1, 2):
        return Replicate()
    if kinds == ("shard",):
        return Shard(0)
    if kinds == ("replicate", "shard"):
        hybrid = getattr(flexshard, "HybridShard", None)
        if hybrid is None:
            raise _refuse(name, mesh, placements, "HSDP needs flexshard.HybridShard, which this flexshard does not have yet")
        return hybrid(mesh.size(1))
    raise _refuse(name, mesh, placements, "this placement is not supported")


def _kind(p: Any) -> str:
    # exact types: _StridedShard derives from Shard and must not pass for it
    if type(p) is DShard and p.dim == 0:
        return "shard"
    if type(p) is DReplicate:
        return "replicate"
    return "other"


def _piece_by_coordinate(placements: tuple, shape: tuple[int, ...], mesh: Any, coordinate: list[int]) -> tuple[int, int]:
    """The flat element range a rank holds, from its mesh coordinate alone (torch.chunk
    split of dim 0 over the shard mesh dim)."""
    total = 1
    for s in shape:
        total *= s
    shard_dims = [i for i, p in enumerate(placements) if type(p) is DShard]
    if not shard_dims:
        return (0, total)
    i = shard_dims[0]
    parts, index = mesh.size(i), coordinate[i]
    rows = shape[0] if shape else 1
    per_row = total // rows if rows else 0
    step = -(-rows // parts)
    first = min(index * step, rows)
    last = min(first + step, rows)
    return (first * per_row, last * per_row)
