"""flexshard: where training state lives across data-parallel ranks.

Layouts (``Replicate``, ``Shard(0)``, ``Owned``, ``BlockShard``) map a global tensor to one
contiguous flat range per rank; ``ShardedTensor`` is one rank's piece. Package boundary:
``trainer -> flexshard -> torch``; flexshard never imports flexckpt or zephon_state.
"""
from flexshard.layout import (
    BlockShard,
    Layout,
    Owned,
    Replicate,
    Shard,
    holders,
    layout_from_json,
    local_shape,
)
from flexshard.owner import assign_owners, rank_loads
from flexshard.ranges import FlatRange, Overlap, covering, overlaps
from flexshard.sharded import ShardedTensor
from flexshard.world import current_world

__all__ = [
    "BlockShard",
    "FlatRange",
    "Layout",
    "Overlap",
    "Owned",
    "Replicate",
    "Shard",
    "ShardedTensor",
    "assign_owners",
    "covering",
    "current_world",
    "holders",
    "layout_from_json",
    "local_shape",
    "overlaps",
    "rank_loads",
]
