"""Where a fast-tier step lives: node identity and the fixed partner rule (pure functions).

A node is named by its host name (``FLEXCKPT_NODE`` overrides it, for tests that emulate
nodes on one machine). Nodes are ordered by their lowest rank; rank ``r`` at position
``i`` of node ``n`` copies its files to position ``i mod len`` of nodes ``n+1 .. n+R``
(mod the node count): every copy lands on another node, and a node's ranks spread their
copies over the next nodes' ranks."""
from __future__ import annotations

import os
import socket


def node_name() -> str:
    """The host name, or ``FLEXCKPT_NODE``, formatted with the environment (``node{RANK}``
    makes every rank of a torchrun job a node of its own: for tests)."""
    given = os.environ.get("FLEXCKPT_NODE")
    return given.format(**os.environ) if given else socket.gethostname()


def nodes_of(names: list[str]) -> list[list[int]]:
    """Ranks grouped by node name, nodes ordered by their lowest rank."""
    order: dict[str, list[int]] = {}
    for rank, name in enumerate(names):
        order.setdefault(name, []).append(rank)
    return list(order.values())


def partners(rank: int, nodes: list[list[int]], replicas: int) -> list[int]:
    """The ranks that hold copies of ``rank``'s files (each on another node)."""
    n = next(i for i, ranks in enumerate(nodes) if rank in ranks)
    pos = nodes[n].index(rank)
    out = []
    for k in range(1, min(replicas, len(nodes) - 1) + 1):
        other = nodes[(n + k) % len(nodes)]
        out.append(other[pos % len(other)])
    return out


def sources(rank: int, nodes: list[list[int]], replicas: int) -> list[int]:
    """The ranks whose copies ``rank`` receives."""
    return [s for ranks in nodes for s in ranks if rank in partners(s, nodes, replicas)]
