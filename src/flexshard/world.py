"""The data-parallel world this process belongs to: from ``torch.distributed`` when it
is initialized, else a single process (rank 0 of 1)."""
from __future__ import annotations

import torch.distributed as dist


def ranks(n: int) -> str:
    """A count of ranks for messages: '1 rank', '3 ranks'."""
    return f"{n} rank" if n == 1 else f"{n} ranks"


def current_world(group: "dist.ProcessGroup | None" = None) -> tuple[int, int]:
    """``(rank, world_size)``; never communicates."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1
