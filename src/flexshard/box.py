"""The one geometry of a piece of a tensor: a stretch of a box.

A **box** is offsets and sizes per dimension of a global tensor (DCP's chunk,
ByteCheckpoint's decomposed tensor). A **part** is the elements ``[start, stop)`` of a
box's own row-major order: a rank's n-D piece under tensor parallelism is a whole box
``Part(box, 0, box.numel)``; a flat range of the global tensor (every flexshard layout,
a dim-0 slab) is the same idea on the whole tensor, ``Part(whole(shape), start, stop)``.
A part is stored contiguously, in that order.

:func:`runs` intersects two parts: the elements they share, as runs that are contiguous
in both, so a load reads whole runs and copies each with one memcpy. Pure functions.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import numpy as np

Shape = tuple[int, ...]


class Box(NamedTuple):
    offsets: Shape
    sizes: Shape

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def intersect(self, other: "Box") -> "Box | None":
        """The common box, or None when they share no element (empty boxes share none)."""
        offs, sizes = [], []
        for a, n, b, m in zip(self.offsets, self.sizes, other.offsets, other.sizes):
            lo, hi = max(a, b), min(a + n, b + m)
            if hi <= lo:
                return None
            offs.append(lo)
            sizes.append(hi - lo)
        return Box(tuple(offs), tuple(sizes))


def whole(shape: Sequence[int]) -> Box:
    shape = tuple(map(int, shape))
    return Box((0,) * len(shape), shape)


class Part(NamedTuple):
    """Elements ``[start, stop)`` of ``box``'s row-major order, stored contiguously."""

    box: Box
    start: int
    stop: int

    def __len__(self) -> int:
        return max(0, self.stop - self.start)


def flat_part(shape: Sequence[int], start: int, stop: int) -> Part:
    """A flat range of the global tensor, as a part of the whole tensor."""
    return Part(whole(shape), start, stop)


def box_part(box: Box) -> Part:
    return Part(box, 0, box.numel)


def _strides(sizes: Shape) -> list[int]:
    out, acc = [0] * len(sizes), 1
    for d in range(len(sizes) - 1, -1, -1):
        out[d] = acc
        acc *= sizes[d]
    return out


def bounding_box(part: Part) -> Box | None:
    """The smallest box holding every element of ``part`` (whole trailing rows)."""
    box = part.box
    if part.stop <= part.start:
        return None
    if not box.sizes:
        return box
    if part.start == 0 and part.stop == box.numel:
        return box
    row = math.prod(box.sizes[1:])
    if row == 0:
        return None
    first, last = part.start // row, -(-part.stop // row)
    return Box((box.offsets[0] + first, *box.offsets[1:]), (last - first, *box.sizes[1:]))


_EMPTY = np.zeros((0, 3), dtype=np.int64)


def runs(src: Part, dst: Part) -> np.ndarray:
    """The elements two parts of one tensor share, as ``(src_pos, dst_pos, length)`` rows:
    ``length`` elements that sit contiguously at ``src_pos`` of ``src`` (counted from
    ``src.start``) and at ``dst_pos`` of ``dst``. In ``src`` order; each shared element
    once. Runs are as long as both orders allow: the trailing dimensions that both boxes
    and their common box span in full, times the extent of the last one that is not."""
    s_box, d_box = bounding_box(src), bounding_box(dst)
    if s_box is None or d_box is None:
        return _EMPTY
    common = s_box.intersect(d_box)
    if common is None:
        return _EMPTY
    S, T = src.box, dst.box
    n = len(S.sizes)
    if n == 0:
        lo, hi = max(src.start, dst.start), min(src.stop, dst.stop)
        return np.array([[lo - src.start, lo - dst.start, hi - lo]], dtype=np.int64) if lo < hi else _EMPTY
    j = 0  # the runs are contiguous over dims [j, n)
    for d in range(n - 1, -1, -1):
        if not (common.sizes[d] == S.sizes[d] == T.sizes[d]):
            j = d
            break
    length = math.prod(common.sizes[j:])
    s_strides, t_strides = _strides(S.sizes), _strides(T.sizes)
    s_base = sum((c - o) * st for c, o, st in zip(common.offsets, S.offsets, s_strides))
    t_base = sum((c - o) * st for c, o, st in zip(common.offsets, T.offsets, t_strides))
    if j == 0:
        s0 = np.array([s_base], dtype=np.int64)
        t0 = np.array([t_base], dtype=np.int64)
    else:
        grid = np.indices(common.sizes[:j], dtype=np.int64).reshape(j, -1)
        s0 = s_base + (np.array(s_strides[:j], dtype=np.int64) @ grid)
        t0 = t_base + (np.array(t_strides[:j], dtype=np.int64) @ grid)
    lo = np.maximum(np.maximum(src.start - s0, dst.start - t0), 0)
    hi = np.minimum(np.minimum(src.stop - s0, dst.stop - t0), length)
    keep = lo < hi
    if not keep.all():
        s0, t0, lo, hi = s0[keep], t0[keep], lo[keep], hi[keep]
    return np.stack([s0 + lo - src.start, t0 + lo - dst.start, hi - lo], axis=1)


__all__ = ["Box", "Part", "bounding_box", "box_part", "flat_part", "runs", "whole"]
