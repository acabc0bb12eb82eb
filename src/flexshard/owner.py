"""Deterministic owner assignment for ``Owned`` tensors: every rank computes the same
answer from the same inputs, with no communication."""
from __future__ import annotations

import heapq
from typing import Mapping


def assign_owners(costs: Mapping[str, float], world_size: int) -> dict[str, int]:
    """Largest cost first onto the least-loaded rank; ties by name, then by rank.

    ``costs`` maps a tensor name to its cost (bytes by default; a matrix optimizer passes
    its per-matrix FLOPs). The result does not depend on the mapping's iteration order.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    for name, cost in costs.items():
        if not isinstance(name, str):
            raise TypeError(f"owner names must be str, got {name!r}")
        if not cost >= 0:  # also rejects NaN
            raise ValueError(f"cost of {name!r} must be >= 0, got {cost!r}")
    heap = [(0.0, r) for r in range(world_size)]
    owners: dict[str, int] = {}
    for name in sorted(costs, key=lambda n: (-costs[n], n)):
        load, rank = heapq.heappop(heap)
        owners[name] = rank
        heapq.heappush(heap, (load + float(costs[name]), rank))
    return owners


def rank_loads(costs: Mapping[str, float], owners: Mapping[str, int], world_size: int) -> list[float]:
    """Total cost per rank under an assignment."""
    loads = [0.0] * world_size
    for name, rank in owners.items():
        loads[rank] += float(costs[name])
    return loads
