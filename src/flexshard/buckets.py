"""Buckets: many tensors' pieces packed into one flat buffer per rank, so that one
collective moves all of them.

Rank ``r``'s bucket is the concatenation of the pieces rank ``r`` holds, in entry order.
Collectives over process groups need equal sizes, so every bucket is padded to the largest
one; the padding is sent and counted. Everything here is pure arithmetic over sizes: every
rank computes the same plan with no communication.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from flexshard.layout import Layout, normalize_shape
from flexshard.ranges import FlatRange


@dataclass(frozen=True)
class BucketPlan:
    """``sizes[rank][entry]``: how many elements of entry ``entry`` rank ``rank`` holds."""

    sizes: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if not self.sizes:
            raise ValueError("a bucket plan needs at least one rank")
        widths = {len(row) for row in self.sizes}
        if len(widths) != 1:
            raise ValueError(f"every rank must list the same entries, got lengths {sorted(widths)}")
        if any(s < 0 for row in self.sizes for s in row):
            raise ValueError(f"sizes must be >= 0, got {self.sizes}")

    @classmethod
    def for_layouts(cls, specs: Sequence[tuple[Sequence[int], Layout]], world_size: int) -> "BucketPlan":
        """Element counts of each (global shape, layout) piece on every rank."""
        return cls(
            tuple(
                tuple(len(layout.flat_range(normalize_shape(shape), world_size, r)) for shape, layout in specs)
                for r in range(world_size)
            )
        )

    @property
    def world_size(self) -> int:
        return len(self.sizes)

    @property
    def entries(self) -> int:
        return len(self.sizes[0])

    def total(self, rank: int) -> int:
        return sum(self.sizes[rank])

    @property
    def padded(self) -> int:
        """Elements in every rank's (padded) bucket."""
        return max(self.total(r) for r in range(self.world_size))

    def slot(self, rank: int, entry: int) -> FlatRange:
        """Where entry ``entry``'s piece sits inside rank ``rank``'s bucket."""
        start = sum(self.sizes[rank][:entry])
        return FlatRange(start, start + self.sizes[rank][entry])

    def padding(self, rank: int) -> int:
        return self.padded - self.total(rank)

    def pack(self, pieces: Sequence[torch.Tensor], rank: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's bucket (padded with zeros) from its pieces, in entry order."""
        if len(pieces) != self.entries:
            raise ValueError(f"expected {self.entries} pieces, got {len(pieces)}")
        dtype = pieces[0].dtype if pieces else torch.float32
        if out is None:
            out = torch.empty(self.padded, dtype=dtype, device=pieces[0].device if pieces else None)
        for i, piece in enumerate(pieces):
            r = self.slot(rank, i)
            if piece.numel() != len(r):
                raise ValueError(f"piece {i} of rank {rank} has {piece.numel()} elements, the plan says {len(r)}")
            out[r.start : r.stop].copy_(piece.reshape(-1))
        out[self.total(rank) :].zero_()
        return out
