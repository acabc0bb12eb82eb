"""Parameter gathers by layout: whole tensors from their pieces on every rank, in full
precision or as MXFP8.

- ``all_gather_mx``: each rank quantizes its own piece and the group gathers FP8 bytes and
  scales. Exact (bit-identical to gathering fp32 and quantizing after) whenever no block
  straddles two ranks: always for row blocks of a matrix, and for ``BlockShard(32)`` in
  every orientation. Where blocks would straddle (``Shard(0)`` with ``ceil(rows / W)`` not
  a multiple of 32) it refuses and names the fix.
- ``all_gather_bf16_then_quantize``: the ``Shard(0)`` baseline: gather bf16, quantize after.
- ``broadcast_owned``: an ``Owned`` tensor from its owner, in full precision or MXFP8.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from flexshard.buckets import BucketPlan
from flexshard.collectives import WireStats, all_gather_bucket, as_bytes, broadcast_bytes
from flexshard.layout import Layout, Replicate, local_shape, normalize_shape, numel, row_numel
from flexshard.mxfp8 import Blocks, MXBlocks, quantize, scale_shape, wire_bytes
from flexshard.sharded import ShardedTensor
from flexshard.world import current_world

Group = Optional[dist.ProcessGroup]


def all_gather_tensor(piece: ShardedTensor, group: Group = None, stats: WireStats | None = None) -> torch.Tensor:
    """The whole tensor, in ``piece``'s dtype, on every rank."""
    shape, layout, world = piece.global_shape, piece.layout, piece.world_size
    if isinstance(layout, Replicate):
        return piece.local.clone()
    item = piece.local.element_size()
    sizes = [numel(local_shape(layout, shape, world, r)) * item for r in range(world)]
    parts = _gather_byte_pieces(as_bytes(piece.local), sizes, piece.rank, group, stats)
    return torch.cat(parts).view(piece.dtype).view(shape)


def all_gather_mx(
    piece: ShardedTensor,
    blocks: Blocks = "row",
    block_size: int = 32,
    group: Group = None,
    stats: WireStats | None = None,
) -> MXBlocks:
    """The whole tensor as MXFP8 on every rank, each rank quantizing only its own piece."""
    shape, layout, world = piece.global_shape, piece.layout, piece.world_size
    if isinstance(layout, Replicate):
        return quantize(piece.local, block_size, blocks)
    check_blocks_stay_whole(shape, layout, world, blocks, block_size)
    mine = pack_mx(quantize(piece.local, block_size, blocks))
    sizes = [wire_bytes(local_shape(layout, shape, world, r), blocks, block_size) for r in range(world)]
    parts = _gather_byte_pieces(mine, sizes, piece.rank, group, stats)
    return unpack_mx(parts, shape, layout, world, blocks, block_size)


def all_gather_bf16_then_quantize(
    piece: ShardedTensor,
    blocks: Blocks = "row",
    block_size: int = 32,
    group: Group = None,
    stats: WireStats | None = None,
) -> MXBlocks:
    """Baseline for layouts whose pieces split blocks: gather bf16 (2 bytes an element),
    then every rank quantizes the whole tensor."""
    local = ShardedTensor(piece.local.to(torch.bfloat16), piece.layout, piece.global_shape, piece.rank, piece.world_size)
    return quantize(all_gather_tensor(local, group, stats), block_size, blocks)


def broadcast_owned(
    tensor: torch.Tensor | None,
    global_shape: Sequence[int],
    owner: int,
    dtype: torch.dtype = torch.float32,
    blocks: Blocks | None = None,
    block_size: int = 32,
    group: Group = None,
    stats: WireStats | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor | MXBlocks:
    """An ``Owned`` tensor on every rank: the owner passes it, the others pass None (and
    receive on ``device``: the default device, CPU unless set; a GPU for NCCL).
    With ``blocks`` the owner sends MXFP8 (bytes and scales) and every rank gets MXBlocks."""
    rank, world = current_world(group)
    shape = normalize_shape(global_shape)
    if rank == owner and (tensor is None or tuple(tensor.shape) != shape):
        raise ValueError(f"the owner (rank {owner}) must pass its tensor of shape {shape}, got "
                         f"{None if tensor is None else tuple(tensor.shape)}")
    if blocks is None:
        nbytes = numel(shape) * torch.empty((), dtype=dtype).element_size()
        buf = as_bytes(tensor.to(dtype)).clone() if rank == owner else torch.empty(nbytes, dtype=torch.uint8, device=device)
        return broadcast_bytes(buf, owner, group, stats).view(dtype).view(shape)
    nbytes = wire_bytes(shape, blocks, block_size)
    buf = pack_mx(quantize(tensor, block_size, blocks)) if rank == owner else torch.empty(nbytes, dtype=torch.uint8, device=device)
    broadcast_bytes(buf, owner, group, stats)
    return _split_mx(buf, shape, blocks, block_size)


# --- pure packing ----------------------------------------------------------------------------

def pack_mx(mx: MXBlocks) -> torch.Tensor:
    """One flat ``uint8`` buffer: element bytes, then scale bytes."""
    return torch.cat([as_bytes(mx.data), mx.scale.reshape(-1)])


def _split_mx(buf: torch.Tensor, shape: tuple[int, ...], blocks: str, block_size: int) -> MXBlocks:
    n = numel(shape)
    sshape = scale_shape(shape, blocks, block_size)
    data = buf[:n].view(torch.float8_e4m3fn).view(shape)
    return MXBlocks(buf[n : n + numel(sshape)].view(sshape), data, blocks, block_size)


def unpack_mx(
    parts: Sequence[torch.Tensor],
    global_shape: Sequence[int],
    layout: Layout,
    world_size: int,
    blocks: Blocks = "row",
    block_size: int = 32,
) -> MXBlocks:
    """The whole MXFP8 tensor from every rank's packed piece (rank order). Pieces are row
    slabs holding whole blocks, so element bytes and scale rows simply concatenate."""
    shape = normalize_shape(global_shape)
    data, scales = [], []
    for r, buf in enumerate(parts):
        piece = _split_mx(buf, local_shape(layout, shape, world_size, r), blocks, block_size)
        data.append(as_bytes(piece.data))
        scales.append(piece.scale.reshape(-1))
    return MXBlocks(
        torch.cat(scales).view(scale_shape(shape, blocks, block_size)),
        torch.cat(data).view(torch.float8_e4m3fn).view(shape),
        blocks,
        block_size,
    )


def check_blocks_stay_whole(
    shape: Sequence[int], layout: Layout, world_size: int, blocks: str, block_size: int = 32
) -> None:
    """Raise if some rank's piece starts inside a block, so that a block would straddle ranks."""
    shape = normalize_shape(shape)
    spans_rows = blocks != "row" or len(shape) == 1  # 1-D row blocks run along dim 0 too
    if not spans_rows:
        return
    per_row = row_numel(shape)
    for r in range(world_size):
        rng = layout.flat_range(shape, world_size, r)
        if len(rng) and per_row and (rng.start // per_row) % block_size:
            first = rng.start // per_row
            raise ValueError(
                f"{layout} gives rank {r} of {world_size} rows from {first} of global shape {shape}: "
                f"{block_size}-row {blocks} blocks would straddle ranks. Use BlockShard({block_size}) "
                f"for this tensor, or gather in bf16 and quantize after (all_gather_bf16_then_quantize)"
            )


def _gather_byte_pieces(
    mine: torch.Tensor, sizes: list[int], rank: int, group: Group, stats: WireStats | None
) -> list[torch.Tensor]:
    """Every rank's byte piece (unequal sizes), through one padded all-gather."""
    if mine.numel() != sizes[rank]:
        raise ValueError(f"rank {rank} packed {mine.numel()} bytes, its layout says {sizes[rank]}")
    plan = BucketPlan(tuple((s,) for s in sizes))
    gathered = all_gather_bucket(plan, plan.pack([mine], rank), group, stats)
    return [gathered[r, : sizes[r]] for r in range(len(sizes))]
