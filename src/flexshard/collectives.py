"""Wire-level collectives over ``torch.distributed`` that gloo and NCCL both run: every
payload travels as equal-sized buffers (gloo takes no unequal sizes and no float8 dtypes;
the ``uint8`` views cost nothing on NCCL, and its all-to-all needs equal splits too), and
every call records the bytes this rank puts on the wire, padding included. Buffers live on
the device of the tensors passed in (CPU for gloo, the rank's GPU for NCCL).

Byte model (checked against the bytes gloo writes to its sockets in the tests):
- all-gather of ``P``-byte buffers, run as ``W - 1`` point-to-point sends of the same
  buffer (gloo; NCCL runs its own): a rank sends ``(W - 1) * P``;
- reduce-scatter of ``W`` segments of ``P`` bytes, run as one all-to-all plus a local sum
  in rank order: ``(W - 1) * P``. (gloo's own reduce-scatter all-reduces the whole
  buffer, ``2 (W - 1) / W`` of it per rank, and its reduce is no cheaper; the all-to-all
  moves half as much and sums in a fixed order, so every rank gets the same bits);
- broadcast of ``N`` bytes: gloo's binomial tree, a rank sends ``N`` once per child.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from flexshard.buckets import BucketPlan
from flexshard.ranges import FlatRange
from flexshard.world import current_world, ranks


# torch 2.13 renames all_gather_into_tensor (deprecated there); torch 2.11 has only that name
_ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def process_bytes_written() -> int | None:
    """Bytes this process has written through syscalls so far (``wchar`` of
    ``/proc/self/io``), to check modelled wire bytes against what gloo sends; None where
    the file does not exist."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


@dataclass
class WireStats:
    """Bytes this rank sent, padding included (``padding_bytes`` says how much of it)."""

    bytes_sent: int = 0
    padding_bytes: int = 0
    calls: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)

    def record(self, kind: str, sent: int, padding: int = 0) -> None:
        self.bytes_sent += sent
        self.padding_bytes += padding
        self.calls += 1
        self.by_kind[kind] = self.by_kind.get(kind, 0) + sent

    def reset(self) -> None:
        self.bytes_sent = self.padding_bytes = self.calls = 0
        self.by_kind.clear()


def _record(stats: WireStats | None, kind: str, sent: int, padding: int = 0) -> None:
    if stats is not None:
        stats.record(kind, sent, padding)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat ``uint8`` view of a contiguous tensor (copies only if not contiguous)."""
    t = t.contiguous().reshape(-1)
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def all_gather_bucket(
    plan: BucketPlan,
    mine: torch.Tensor,
    group: "dist.ProcessGroup | None" = None,
    stats: WireStats | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """All ranks' padded buckets, as a ``(W, plan.padded)`` tensor of ``mine``'s dtype
    (written into ``out`` if given; ``mine`` may be ``out[rank]`` itself). ``mine`` is
    this rank's bucket, already padded to ``plan.padded`` elements.

    On gloo it runs as ``W - 1`` sends of ``mine`` and ``W - 1`` receives straight into
    the rows of ``out``, all in flight at once: the same ``(W - 1) * P`` bytes per rank as
    gloo's ring all-gather, sent to all peers at once (its ring takes two to three times
    as long), and no ``W`` copies of the bucket into an all-to-all buffer."""
    rank, world = current_world(group)
    _check_plan(plan, world)
    if mine.numel() != plan.padded:
        raise ValueError(f"bucket has {mine.numel()} elements, the plan pads to {plan.padded}")
    if out is None:
        out = torch.empty((world, plan.padded), dtype=mine.dtype, device=mine.device)
    elif tuple(out.shape) != (world, plan.padded) or out.dtype != mine.dtype:
        raise ValueError(f"out must be {(world, plan.padded)} {mine.dtype}, got {tuple(out.shape)} {out.dtype}")
    mine = mine.reshape(-1)
    item = mine.element_size()
    if world > 1 and not sends_point_to_point(group):
        _ALL_GATHER_SINGLE(as_bytes(out), as_bytes(mine), group=group)  # in place when mine is out[rank]
    else:
        if out[rank].data_ptr() != mine.data_ptr():
            out[rank].copy_(mine)
        if world == 1:
            return out
        _exchange_shifted(group, rank, world, lambda to, frm: [(mine, out[frm])])
    _record(stats, "all_gather", (world - 1) * plan.padded * item, (world - 1) * plan.padding(rank) * item)
    return out


def all_gather_pieces(
    ranges: Sequence[Sequence[FlatRange]],
    mine: Sequence[torch.Tensor],
    whole: Sequence[torch.Tensor],
    group: "dist.ProcessGroup | None" = None,
    stats: WireStats | None = None,
) -> None:
    """Every rank's pieces into the whole tensors, with no bucket: this rank's piece
    ``mine[i]`` (contiguous, ``ranges[rank][i]`` of entry ``i``) goes straight from its
    memory to every peer, and each peer's piece lands straight in ``whole[i]`` (flat,
    contiguous, one dtype with ``mine``) at ``ranges[peer][i]``; this rank's own piece is
    copied in. Point-to-point sends, all in flight at once; a rank sends ``(W - 1)`` times
    the bytes it holds (no padding)."""
    rank, world = current_world(group)
    if len(ranges) != world or len(mine) != len(whole) or any(len(row) != len(mine) for row in ranges):
        raise ValueError(f"need {world} rows of {len(mine)} ranges, {len(mine)} pieces and {len(mine)} tensors")
    for i, (piece, flat) in enumerate(zip(mine, whole)):
        own = ranges[rank][i]
        if piece.numel() != len(own) or piece.dtype != flat.dtype:
            raise ValueError(f"entry {i}: piece of {piece.numel()} {piece.dtype}, the range holds {len(own)} {flat.dtype}")
        flat[own.start : own.stop].copy_(piece.reshape(-1))
    sent = _exchange_shifted(group, rank, world, lambda to, frm: [
        (piece, flat[ranges[frm][i].start : ranges[frm][i].stop]) for i, (piece, flat) in enumerate(zip(mine, whole))
    ])
    _record(stats, "all_gather", sent)


def _peer(group: "dist.ProcessGroup | None", group_rank: int) -> int:
    """The global rank point-to-point calls take for a rank of ``group``."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def _exchange_shifted(
    group: "dist.ProcessGroup | None",
    rank: int,
    world: int,
    pairs: Callable[[int, int], Sequence[tuple[torch.Tensor, torch.Tensor]]],
) -> int:
    """Point-to-point exchange in ``W - 1`` shifted rounds, all in flight at once: in round
    ``k`` this rank sends to ``to = rank + k`` and receives from ``frm = rank - k`` (mod
    ``W``), so every rank talks to a different peer each round. ``pairs(to, frm)`` lists
    that round's ``(send, recv)`` tensors, posted in that order (``send`` goes to ``to``,
    ``recv`` is filled from ``frm``; both contiguous, empty ones skipped, which both sides
    agree on since a send and its receive hold the same bytes). Returns the bytes sent."""
    works, sent = [], 0
    for k in range(1, world):
        to, frm = (rank + k) % world, (rank - k) % world
        for send, recv in pairs(to, frm):
            if send.numel():
                works.append(dist.isend(as_bytes(send), _peer(group, to), group=group))
                sent += send.numel() * send.element_size()
            if recv.numel():
                works.append(dist.irecv(as_bytes(recv), _peer(group, frm), group=group))
    for w in works:
        w.wait()
    return sent


def _sum_in_rank_order(rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = ((rows[0] + rows[1]) + rows[2]) ...``: a fixed order, so every rank that sums
    the same rows gets the same bits."""
    out.copy_(rows[0])
    for r in range(1, rows.shape[0]):
        out.add_(rows[r])
    return out


def reduce_scatter_bucket(
    plan: BucketPlan,
    send: torch.Tensor,
    group: "dist.ProcessGroup | None" = None,
    stats: WireStats | None = None,
    out: torch.Tensor | None = None,
    scratch: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sum over ranks of segment ``rank`` of every rank's ``send`` (``(W, plan.padded)``,
    segment ``r`` holding what rank ``r`` keeps), added in rank order ``((s0 + s1) + s2)...``
    so the bits do not depend on which rank computes them. Written into ``out`` if given;
    ``scratch`` (shaped like ``send``) receives the segments, else a new buffer does."""
    rank, world = current_world(group)
    _check_plan(plan, world)
    if tuple(send.shape) != (world, plan.padded):
        raise ValueError(f"send buffer must be {(world, plan.padded)}, got {tuple(send.shape)}")
    if out is None:
        out = torch.empty(plan.padded, dtype=send.dtype, device=send.device)
    if world == 1:
        return out.copy_(send[0])
    send = send.contiguous()
    recv = torch.empty_like(send) if scratch is None else scratch
    if recv.shape != send.shape or recv.dtype != send.dtype:
        raise ValueError(f"scratch must be {tuple(send.shape)} {send.dtype}, got {tuple(recv.shape)} {recv.dtype}")
    dist.all_to_all_single(as_bytes(recv), as_bytes(send), group=group)
    _sum_in_rank_order(recv, out)
    item = send.element_size()
    padding = sum(plan.padding(r) for r in range(world) if r != rank)
    _record(stats, "reduce_scatter", (world - 1) * plan.padded * item, padding * item)
    return out


def reduce_scatter_pieces(
    plan: BucketPlan,
    ranges: Sequence[Sequence[FlatRange]],
    flats: Sequence[torch.Tensor],
    group: "dist.ProcessGroup | None" = None,
    stats: WireStats | None = None,
    out: torch.Tensor | None = None,
    scratch: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`reduce_scatter_bucket` without the send buffer: piece ``ranges[r][i]`` of the
    flat tensor ``flats[i]`` goes straight from that tensor's memory to rank ``r`` (a
    point-to-point send per piece, all in flight at once), into segment ``plan.slot(r, i)``
    of its receive buffer ``scratch`` (``(W, plan.padded)``, the dtype of ``flats``). The
    segments are added in rank order, as there, into ``out[:plan.total(rank)]``. Sends
    only the pieces' bytes (no padding); for gloo, whose all-to-all needs one packed buffer."""
    rank, world = current_world(group)
    _check_plan(plan, world)
    if len(ranges) != world or any(len(row) != plan.entries for row in ranges) or len(flats) != plan.entries:
        raise ValueError(f"need {world} rows of {plan.entries} ranges and {plan.entries} tensors")
    dtype, device = flats[0].dtype, flats[0].device
    if out is None:
        out = torch.empty(plan.padded, dtype=dtype, device=device)
    if scratch is None:
        scratch = torch.empty((world, plan.padded), dtype=dtype, device=device)
    elif tuple(scratch.shape) != (world, plan.padded) or scratch.dtype != dtype:
        raise ValueError(f"scratch must be {(world, plan.padded)} {dtype}, got {tuple(scratch.shape)} {scratch.dtype}")
    for i, flat in enumerate(flats):
        src, dst = ranges[rank][i], plan.slot(rank, i)
        if len(src) != len(dst):
            raise ValueError(f"entry {i}: rank {rank} holds {len(src)} elements, the plan says {len(dst)}")
        scratch[rank, dst.start : dst.stop].copy_(flat[src.start : src.stop])
    slots = [plan.slot(rank, i) for i in range(len(flats))]
    sent = _exchange_shifted(group, rank, world, lambda to, frm: [
        (flat[ranges[to][i].start : ranges[to][i].stop], scratch[frm, slots[i].start : slots[i].stop])
        for i, flat in enumerate(flats)
    ])
    total = plan.total(rank)
    _sum_in_rank_order(scratch[:, :total], out[:total])
    _record(stats, "reduce_scatter", sent)
    return out


def broadcast_bytes(
    buf: torch.Tensor,
    src: int,
    group: "dist.ProcessGroup | None" = None,
    stats: WireStats | None = None,
) -> torch.Tensor:
    """Broadcast a ``uint8`` buffer from group rank ``src`` in place."""
    rank, world = current_world(group)
    if buf.dtype != torch.uint8:
        raise TypeError(f"broadcast_bytes sends uint8 buffers, got {buf.dtype}; pass as_bytes(tensor)")
    if world == 1:
        return buf
    if group is None:
        dist.broadcast(buf, src=src)
    else:
        dist.broadcast(buf, group=group, group_src=src)
    _record(stats, "broadcast", binomial_children((rank - src) % world, world) * buf.numel())
    return buf


def binomial_children(relative_rank: int, world_size: int) -> int:
    """How many ranks a node sends to in a binomial-tree broadcast (gloo's algorithm):
    in round ``k`` every node ``v < 2^k`` that has the data sends to ``v + 2^k``."""
    count, k = 0, 0
    while (1 << k) < world_size:
        if (1 << k) > relative_rank and relative_rank + (1 << k) < world_size:
            count += 1
        k += 1
    return count


def sends_point_to_point(group: "dist.ProcessGroup | None" = None) -> bool:
    """Whether the group's all-gather and piece-wise reduce run here as ``W - 1`` rounds of
    point-to-point sends: on gloo (where they are two to three times faster than its ring)
    and any backend but NCCL; NCCL runs its own all-gather (a ring on the device)."""
    return dist.get_backend(group) != "nccl"


def _check_plan(plan: BucketPlan, world: int) -> None:
    if plan.world_size != world:
        raise ValueError(f"bucket plan is for {ranks(plan.world_size)} but the group has {world}")
