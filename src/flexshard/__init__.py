"""flexshard: where training state lives across data-parallel ranks.

Layouts (``Replicate``, ``Shard(0)``, ``Owned``, ``BlockShard``, ``HybridShard``) map a global tensor to one
contiguous flat range per rank; ``MeshLayout`` (a DTensor placement on a device mesh) to one n-D box
per rank, and ``flexshard.box`` is the one geometry of both (a stretch of a box); ``ShardedTensor`` is one rank's piece. On top of them:
MXFP8 blocks (``quantize``/``dequantize``), gathers by layout (block-aligned MXFP8
all-gather, owner broadcast) and ``ShardedOptimizer`` (Muon on ``Owned`` matrices, AdamW on
``BlockShard`` pieces, or the FSDP-only ``Shard(0)`` baseline). Package boundary:
``trainer -> flexshard -> torch``; flexshard never imports flexckpt or zephon_state.
"""
import importlib.metadata

__version__ = importlib.metadata.version("flexckpt")  # the distribution's, from pyproject.toml

from flexshard.layout import (
    BlockShard,
    HybridShard,
    Layout,
    Owned,
    Replicate,
    Shard,
    holders,
    layout_from_json,
    local_shape,
    part_of,
)
from flexshard.box import Box, Part, box_part, flat_part, runs
from flexshard.mesh_layout import MeshLayout
from flexshard.adamw import AdamWConfig
from flexshard.collectives import WireStats
from flexshard.gather import all_gather_bf16_then_quantize, all_gather_mx, all_gather_tensor, broadcast_owned
from flexshard.muon import MuonConfig
from flexshard.mxfp8 import MXBlocks, dequantize, quantize
from flexshard.newton_schulz import newton_schulz_flops, orthogonalize
from flexshard.optimizer import ShardedOptimizer, ShardingConfig, plan_layouts
from flexshard.owner import assign_owners, rank_loads
from flexshard.ranges import FlatRange, Overlap, covering, overlaps
from flexshard.sharded import ShardedTensor
from flexshard.world import current_world

__all__ = [
    "__version__",
    "AdamWConfig",
    "BlockShard",
    "Box",
    "MeshLayout",
    "Part",
    "box_part",
    "flat_part",
    "part_of",
    "runs",
    "FlatRange",
    "HybridShard",
    "Layout",
    "MXBlocks",
    "MuonConfig",
    "Overlap",
    "Owned",
    "Replicate",
    "Shard",
    "ShardedOptimizer",
    "ShardedTensor",
    "ShardingConfig",
    "WireStats",
    "all_gather_bf16_then_quantize",
    "all_gather_mx",
    "all_gather_tensor",
    "assign_owners",
    "broadcast_owned",
    "covering",
    "current_world",
    "dequantize",
    "holders",
    "layout_from_json",
    "local_shape",
    "newton_schulz_flops",
    "orthogonalize",
    "overlaps",
    "plan_layouts",
    "quantize",
    "rank_loads",
]
