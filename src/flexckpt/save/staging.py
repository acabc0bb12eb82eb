"""Staging: one flat, reused buffer per checkpoint in flight, and the copy of a rank's
pieces into it.

A buffer is allocated (and its pages touched) once, then reused save after save; the
destination views for a write plan are built once per (buffer, plan). The copy itself is
one ``torch._foreach_copy_`` call, so its Python cost does not grow with the tensor count.
Tensors on a GPU are copied into pinned memory with non-blocking copies on a side stream
(:class:`StreamCopies`); the choice is made in one place, :func:`copies_for`.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from flexckpt.format.write_plan import RankPlan
from flexckpt.state.structure import TensorSpec
from flexckpt.storage import DIRECT_ALIGN as ALIGN


@dataclass(eq=False)
class StagingBuffer:
    """A flat uint8 buffer, allocated lazily by :meth:`ensure` on the staging thread (a
    first save then costs the trainer nothing for allocation and page faults)."""

    data: torch.Tensor | None = None  # flat uint8, page-aligned, a multiple of ALIGN long; pinned for GPUs
    lease: int = 0  # counts the pool's acquisitions of it: which save's bytes it holds (BufferPool.share)
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
    the bound on memory, and the wait counts as trainer wait).

    A buffer may have several holders: the persistent save that staged it, and a fast-tier
    save of the same step that takes its bytes from it (:meth:`share`). It goes back to
    the pool, to be staged into again, only when the last holder releases it; so the next
    staging into it waits until every reader is done with it."""

    def __init__(self, capacity: int) -> None:
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"max_in_flight must be an int >= 1, got {capacity!r}")
        self.capacity = capacity
        self._free: list[StagingBuffer] = [StagingBuffer() for _ in range(capacity)]
        self._holders: dict[int, int] = {}  # id of a buffer in use -> its holders
        self._cond = threading.Condition()

    def acquire(self) -> StagingBuffer:
        with self._cond:
            while not self._free:
                self._cond.wait()
            buf = self._free.pop()
            buf.lease += 1
            self._holders[id(buf)] = 1
            return buf

    def share(self, buf: StagingBuffer, lease: int) -> bool:
        """One more holder of ``buf`` while it still holds the save of acquisition ``lease``
        (``buf.lease`` then): False, holding nothing, once that save's holders have all
        released it (it may hold another save's bytes by now)."""
        with self._cond:
            if id(buf) not in self._holders or buf.lease != lease:
                return False
            self._holders[id(buf)] += 1
            return True

    def release(self, buf: StagingBuffer) -> None:
        with self._cond:
            left = self._holders[id(buf)] - 1
            if left:
                self._holders[id(buf)] = left
                return
            del self._holders[id(buf)]
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


class HostCopies:
    """Staging of CPU tensors: one ``_foreach_copy_`` on the staging thread."""

    device = torch.device("cpu")

    def ready(self) -> None:
        """Called by ``save()`` on the training thread: nothing to mark on a CPU."""
        return None

    def copy(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor], ready: object = None) -> None:
        if srcs:
            torch._foreach_copy_(dsts, srcs)


class CudaStreams:
    """The few ``torch.cuda`` calls :class:`StreamCopies` makes (a test passes a fake with
    the same methods, so the ordering logic runs without a GPU)."""

    def current_stream(self, device: torch.device) -> "torch.cuda.Stream":
        return torch.cuda.current_stream(device)

    def new_stream(self, device: torch.device) -> "torch.cuda.Stream":
        return torch.cuda.Stream(device=device)

    def new_event(self) -> "torch.cuda.Event":
        return torch.cuda.Event()

    def use(self, stream: "torch.cuda.Stream") -> "torch.cuda.StreamContext":
        return torch.cuda.stream(stream)


class StreamCopies:
    """Device-to-host staging on a side stream of ``device``. ``save()`` calls
    :meth:`ready` on the training thread: an event on the training stream, after the
    work that produced the state (nothing is copied there). The staging thread calls
    :meth:`copy`: the side stream waits for that event, copies every piece with
    ``non_blocking=True`` into the (pinned) staging views, records ``done`` and the
    thread waits for it; ``wait_staged()`` returns after that. The sources stay
    referenced until then, so the caching allocator cannot hand their memory out while
    the side stream still reads it (no ``record_stream`` needed)."""

    def __init__(self, device: torch.device, streams: CudaStreams | None = None) -> None:
        self.device = device
        self.streams = streams or CudaStreams()
        self._side = None

    def ready(self) -> object:
        event = self.streams.new_event()
        event.record(self.streams.current_stream(self.device))
        return event

    def copy(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor], ready: object) -> None:
        if not srcs:
            return
        if self._side is None:
            self._side = self.streams.new_stream(self.device)
        side = self._side
        with self.streams.use(side):
            side.wait_event(ready)
            torch._foreach_copy_(dsts, srcs, non_blocking=True)
            done = self.streams.new_event()
            done.record(side)
        done.synchronize()


def staging_device(devices: "set[torch.device]") -> torch.device:
    """The one device a rank's pieces are staged from: the CPU, or its accelerator (CPU
    pieces beside it are copied on the same stream, synchronously)."""
    others = sorted({d for d in devices if d.type != "cpu"}, key=str)
    if len(others) > 1:
        raise ValueError(
            f"this rank's state spans devices {[str(d) for d in others]}; a rank checkpoints from one "
            f"accelerator: move the tensors to one device (or to the CPU) before save()"
        )
    return others[0] if others else torch.device("cpu")


def copies_for(device: torch.device) -> "HostCopies | StreamCopies":
    """How staging copies from ``device`` (the one place that decides)."""
    return HostCopies() if device.type == "cpu" else StreamCopies(device)
