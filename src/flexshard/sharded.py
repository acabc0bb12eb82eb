"""``ShardedTensor``: this rank's piece of a global tensor, with the layout that says
which piece it is."""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Sequence

import torch

from flexshard.box import Part
from flexshard.layout import Layout, LAYOUT_TYPES, local_shape, normalize_shape, numel, part_of
from flexshard.ranges import FlatRange
from flexshard.world import current_world


@dataclass(frozen=True, eq=False)
class ShardedTensor:
    """``local`` holds the elements ``layout.flat_range(global_shape, world_size, rank)``
    of the global tensor, in row-major order. ``rank`` and ``world_size`` default to the
    current ``torch.distributed`` world (rank 0 of 1 without one)."""

    local: torch.Tensor
    layout: Layout
    global_shape: tuple[int, ...]
    rank: int | None = None
    world_size: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.local, torch.Tensor):
            raise TypeError(f"ShardedTensor.local must be a torch.Tensor, got {type(self.local).__name__}")
        if not isinstance(self.layout, LAYOUT_TYPES):
            raise TypeError(f"ShardedTensor.layout must be a flexshard layout, got {self.layout!r}")
        object.__setattr__(self, "global_shape", normalize_shape(self.global_shape))
        if self.rank is None or self.world_size is None:
            rank, world = current_world()
            object.__setattr__(self, "rank", rank if self.rank is None else self.rank)
            object.__setattr__(self, "world_size", world if self.world_size is None else self.world_size)
        part = self.part
        if self.local.numel() != len(part):
            raise ValueError(
                f"ShardedTensor.local has {self.local.numel()} elements but {self.layout} gives rank "
                f"{self.rank} of {self.world_size} "
                + (f"the flat range {(part.start, part.stop)}" if part.box.sizes == self.global_shape
                   else f"the box at {part.box.offsets} of sizes {part.box.sizes}")
                + f" ({len(part)} elements) of global shape {self.global_shape}"
            )

    @property
    def part(self) -> Part:
        """The piece this rank holds (:mod:`flexshard.box`)."""
        return part_of(self.layout, self.global_shape, self.world_size, self.rank)  # type: ignore[arg-type]

    @property
    def flat_range(self) -> FlatRange:
        return self.layout.flat_range(self.global_shape, self.world_size, self.rank)

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype

    @property
    def device(self) -> torch.device:
        return self.local.device

    @property
    def global_numel(self) -> int:
        """Deprecated: use ``math.prod(t.global_shape)``."""
        warnings.warn("ShardedTensor.global_numel is deprecated; use math.prod(t.global_shape)",
                      DeprecationWarning, stacklevel=2)
        return numel(self.global_shape)

    @classmethod
    def from_global(
        cls,
        tensor: torch.Tensor,
        layout: Layout,
        rank: int | None = None,
        world_size: int | None = None,
        copy: bool = True,
    ) -> "ShardedTensor":
        """This rank's piece of a whole tensor (a copy unless ``copy=False``)."""
        if rank is None or world_size is None:
            cur_rank, cur_world = current_world()
            rank = cur_rank if rank is None else rank
            world_size = cur_world if world_size is None else world_size
        shape = tuple(tensor.shape)
        box = getattr(layout, "box", None)
        if box is not None:  # an n-D box: slice each dim
            b = box(shape, world_size, rank)
            piece = tensor[tuple(slice(o, o + n) for o, n in zip(b.offsets, b.sizes))]
            piece = piece.clone(memory_format=torch.contiguous_format) if copy else piece.contiguous()
            return cls(piece, layout, shape, rank, world_size)
        else:
            r = layout.flat_range(shape, world_size, rank)
            piece = tensor.reshape(-1)[r.start : r.stop].view(local_shape(layout, shape, world_size, rank))
        if copy:
            piece = piece.clone()
        return cls(piece, layout, shape, rank, world_size)

    @classmethod
    def empty(
        cls,
        global_shape: Sequence[int],
        layout: Layout,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        rank: int | None = None,
        world_size: int | None = None,
    ) -> "ShardedTensor":
        """An uninitialised piece of the right shape (for example a load target)."""
        if rank is None or world_size is None:
            cur_rank, cur_world = current_world()
            rank = cur_rank if rank is None else rank
            world_size = cur_world if world_size is None else world_size
        shape = normalize_shape(global_shape)
        local = torch.empty(local_shape(layout, shape, world_size, rank), dtype=dtype, device=device)
        return cls(local, layout, shape, rank, world_size)

    def __repr__(self) -> str:
        return (
            f"ShardedTensor(layout={self.layout}, global_shape={self.global_shape}, rank={self.rank}/"
            f"{self.world_size}, local={tuple(self.local.shape)} {self.local.dtype})"
        )
