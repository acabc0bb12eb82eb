"""Half-open ranges of row-major flat indices, and their intersection: the one piece of
math that resharding, checkpoint loading and collectives share."""
from __future__ import annotations

from typing import NamedTuple


class FlatRange(NamedTuple):
    """``[start, stop)`` over a tensor's row-major flat index space."""

    start: int
    stop: int

    def __len__(self) -> int:
        return max(0, self.stop - self.start)

    @property
    def empty(self) -> bool:
        return self.stop <= self.start

    def intersect(self, other: "FlatRange") -> "FlatRange | None":
        """The overlap of two ranges, or None when they share no element."""
        start = max(self.start, other.start)
        stop = min(self.stop, other.stop)
        return FlatRange(start, stop) if start < stop else None

    def shift(self, offset: int) -> "FlatRange":
        return FlatRange(self.start + offset, self.stop + offset)


class Overlap(NamedTuple):
    """Elements ``[start, stop)`` (global flat indices) that a source piece and a target
    piece share, with where they sit inside each piece."""

    start: int
    stop: int
    source_index: int  # which source piece
    source_offset: int  # element offset of ``start`` inside that source piece
    target_offset: int  # element offset of ``start`` inside the target piece


def overlaps(target: FlatRange, sources: list[FlatRange]) -> list[Overlap]:
    """Every overlap between one target range and a list of source ranges, in source
    order. Sources may be replicas of each other; callers that want each element once
    pass a partition (see :func:`covering`)."""
    out = []
    for i, src in enumerate(sources):
        hit = target.intersect(src)
        if hit is not None:
            out.append(Overlap(hit.start, hit.stop, i, hit.start - src.start, hit.start - target.start))
    return out


def covering(target: FlatRange, sources: list[FlatRange]) -> list[Overlap]:
    """The overlaps that cover ``target`` exactly once, taking each element from the first
    source (in list order) that holds it. Raises if some element is held by no source."""
    out: list[Overlap] = []
    pos = target.start
    while pos < target.stop:
        best: Overlap | None = None
        for i, src in enumerate(sources):
            if src.start <= pos < src.stop:
                stop = min(src.stop, target.stop)
                best = Overlap(pos, stop, i, pos - src.start, pos - target.start)
                break
        if best is None:
            raise ValueError(f"element {pos} of range ({target.start}, {target.stop}) is held by no source piece")
        out.append(best)
        pos = best.stop
    return out
