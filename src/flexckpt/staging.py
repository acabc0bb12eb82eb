"""Staging: one flat, reused buffer per checkpoint in flight, and the copy of a rank's
pieces into it.

A buffer is allocated (and its pages touched) once, then reused save after save; the
destination views for a write plan are built once per (buffer, plan). The copy itself is
one ``torch._foreach_copy_`` call, so its Python cost does not grow with the tensor count.
Tensors on a GPU are copied into pinned memory with non-blocking copies on a side stream.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from flexckpt.plan import RankPlan
from flexckpt.storage import DIRECT_ALIGN as ALIGN
from flexckpt.structure import TensorSpec


@dataclass(eq=False)
class StagingBuffer:
    """A flat uint8 buffer, allocated lazily by :meth:`ensure` on the staging thread (a
    first save then costs the trainer nothing for allocation and page faults)."""

    data: torch.Tensor | None = None  # flat uint8, page-aligned, a multiple of ALIGN long; pinned for GPUs
    _views: dict[int, list[torch.Tensor]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return 0 if self.data is None else self.data.numel()

    def ensure(self, nbytes: int, pin: bool) -> None:
        """Room for ``nbytes``, rounded up to ALIGN, starting on an ALIGN boundary (what
        O_DIRECT writes need)."""
        size = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        if self.data is None or self.data.numel() < size or (pin and not self.data.is_pinned()):
            self.data = None
            self._views = {}
            raw = torch.empty(size + ALIGN, dtype=torch.uint8, pin_memory=pin)
            start = -raw.data_ptr() % ALIGN
            self.data = raw[start : start + size]

    def views(self, key: int, plan: RankPlan, specs: tuple[TensorSpec, ...], shapes: list[tuple]) -> list[torch.Tensor]:
        """Destination views of ``plan``'s pieces, shaped like their source tensors."""
        views = self._views.get(key)
        if views is None:
            assert self.data is not None
            self.data.zero_()  # pages touched here; padding stays zero: files are deterministic
            views = [
                self.data[p.offset : p.offset + p.nbytes].view(specs[p.spec_index].dtype).view(shape)
                for p, shape in zip(plan.pieces, shapes)
            ]
            self._views = {key: views}  # only the current plan's views are kept
        return views


class BufferPool:
    """At most ``capacity`` buffers; :meth:`acquire` blocks while all are in use (that is
    the bound on memory, and the wait counts as trainer wait)."""

    def __init__(self, capacity: int) -> None:
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"max_in_flight must be an int >= 1, got {capacity!r}")
        self.capacity = capacity
        self._free: list[StagingBuffer] = [StagingBuffer() for _ in range(capacity)]
        self._cond = threading.Condition()

    def acquire(self) -> StagingBuffer:
        with self._cond:
            while not self._free:
                self._cond.wait()
            return self._free.pop()

    def release(self, buf: StagingBuffer) -> None:
        with self._cond:
            self._free.append(buf)
            self._cond.notify()

    def in_use(self) -> int:
        with self._cond:
            return self.capacity - len(self._free)

    def clear(self) -> None:
        """Drop the memory of idle buffers (they are reallocated on demand)."""
        with self._cond:
            for buf in self._free:
                buf.data = None
                buf._views = {}


def copy_into(
    dsts: list[torch.Tensor],
    srcs: list[torch.Tensor],
    cuda: "tuple[torch.cuda.Stream, torch.cuda.Event] | None" = None,
) -> None:
    """Copy every source into its view; returns when the bytes are in host memory.
    ``cuda`` is (side stream, event recorded on the trainer's stream at save time)."""
    if not srcs:
        return
    if cuda is None:
        torch._foreach_copy_(dsts, srcs)
        return
    stream, ready = cuda
    with torch.cuda.stream(stream):
        stream.wait_event(ready)
        for d, s in zip(dsts, srcs):
            d.copy_(s, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
    done.synchronize()
