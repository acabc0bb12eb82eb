"""DTensor states on 1-3-D meshes for the mesh, pipeline and tensor-parallel tests: a tensor's
global values by name, a DTensor of them on a mesh, bit-exact comparison."""
import math

import torch
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor import Shard as DShard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset as torch_piece
from torch.distributed.tensor.placement_types import _StridedShard


def _torch_placement(code: str):
    if code == "R":
        return Replicate()
    if code.startswith("SS"):
        d, sf = code[2:].split(":")
        return _StridedShard(int(d), split_factor=int(sf))
    return DShard(int(code[1:]))


def _global(name: str, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)) * 31 + len(shape))
    return torch.randn(shape, generator=g)


def dtensor_on(mesh, name: str, shape: tuple, codes, fill: bool):
    """``name``'s DTensor on ``mesh`` with placement ``codes``: this rank's piece of its
    global values (``fill``), or NaN (a load target)."""
    placements = [_torch_placement(c) for c in codes]
    sizes, offsets = torch_piece(shape, tuple(mesh.mesh.shape), list(mesh.get_coordinate()), placements)
    if fill:
        local = _global(name, shape)[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))].clone()
    else:
        local = torch.full(sizes, float("nan"))
    stride = tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))
