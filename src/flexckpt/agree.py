"""What the ranks agree on with a collective, outside the save path: at load, the step
(rank 0 picks, everyone gets it), the manifest's bytes when the load fans out (rank 0
reads them, everyone gets them) and whether any rank failed. With a process group, on its
ranks. (At construction the ids go through the store, not a collective: see :mod:`flexckpt.save.savers`.)"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from flexckpt.errors import LoadError


def distributed(world_size: int) -> bool:
    return world_size > 1 and dist.is_available() and dist.is_initialized()


def collective_device(group: "dist.ProcessGroup | None") -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def global_rank(group_rank: int, group: "dist.ProcessGroup | None") -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def agree_step(rank: int, world_size: int, group: "dist.ProcessGroup | None", steps: Callable[[], list[int]],
               url: str, step: int | None, before: int | None) -> int:
    """The step every rank loads: ``step`` if committed, else the newest committed one (or
    the newest before ``before``), chosen from rank 0's listing (``steps``)."""
    value = -3
    failure: BaseException | None = None
    if rank == 0 or not distributed(world_size):
        try:
            listed = steps()
            if before is not None:
                older = [s for s in listed if s < before]
                value = older[-1] if older else -1
            elif step is None:
                value = listed[-1] if listed else -1
            else:
                value = step if step in listed else -2
        except Exception as exc:  # noqa: BLE001 - reported to every rank below (raised here: not logged)
            failure = exc
            value = -3
    if distributed(world_size):
        t = torch.tensor([value], dtype=torch.int64, device=collective_device(group))
        dist.broadcast(t, src=global_rank(0, group), group=group)
        value = int(t.item())
    if value == -1:
        where = f" before step {before}" if before is not None else ""
        raise LoadError(f"no committed checkpoint{where} under {url}")
    if value == -2:
        raise LoadError(f"step {step} is not a committed checkpoint under {url}; committed: {steps()}")
    if value == -3:
        if failure is not None:
            why = str(failure).removeprefix(f"{url}: ")  # a StorageError names the URL already
            raise LoadError(f"could not list checkpoints under {url}: {why}") from failure
        raise LoadError(f"could not list checkpoints under {url} (see rank 0's error)")
    return value


def share_bytes(rank: int, world_size: int, group: "dist.ProcessGroup | None", read: Callable[[], bytes],
                what: str) -> bytes:
    """Bytes rank 0 reads (``read()``), obtained by every rank: two broadcasts, the length and
    then the bytes (rank 0's own read bounds them). Every rank of the group calls it. When
    rank 0's read fails, it raises that error and every other rank a ``LoadError`` naming
    rank 0 and ``what``; the bytes are untrusted all the same (each rank checks them)."""
    if not distributed(world_size):
        return read()
    data, failure = b"", None
    if rank == 0:
        try:
            data = read()
        except Exception as exc:  # noqa: BLE001 - raised below, after the others know
            failure = exc
    device = collective_device(group)
    n = torch.tensor([-1 if failure is not None else len(data)], dtype=torch.int64, device=device)
    dist.broadcast(n, src=global_rank(0, group), group=group)
    size = int(n.item())
    if size < 0:
        if failure is not None:
            raise failure
        raise LoadError(f"rank 0 could not read {what} for the other ranks; see its error")
    buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if rank == 0 and size
           else torch.empty(size, dtype=torch.uint8))
    if size:
        sent = buf.to(device)
        dist.broadcast(sent, src=global_rank(0, group), group=group)
        if rank != 0:
            buf = sent.cpu()
    return data if rank == 0 else buf.numpy().tobytes()


def first_failed_rank(rank: int, world_size: int, group: "dist.ProcessGroup | None", failed: bool,
                      by_peer: bool = False) -> int | None:
    """The lowest rank whose load failed (``failed`` on it), or None: one all-reduce. A
    rank that failed only because a peer did (``by_peer``: a fanned-out load whose reader
    failed) counts after every rank that failed on its own, so that every rank names the
    cause."""
    if not distributed(world_size):
        return rank if failed else None
    value = (rank + world_size if by_peer else rank) if failed else 2 * world_size
    t = torch.tensor([value], dtype=torch.int64, device=collective_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    first = int(t.item())
    return None if first >= 2 * world_size else first % world_size
