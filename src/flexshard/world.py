"""The data-parallel world this process belongs to: from ``torch.distributed`` when it
is initialized, else a single process (rank 0 of 1)."""
from __future__ import annotations

import torch.distributed as dist


def current_world(group: "dist.ProcessGroup | None" = None) -> tuple[int, int]:
    """``(rank, world_size)``; never communicates."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1
