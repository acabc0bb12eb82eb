"""The small training states the fast-tier tests save: a few tensors sharded over the ranks, filled
from the step so that a restore shows which step it read."""
import torch

from flexckpt import ByLane
from flexshard import Replicate, Shard, ShardedTensor

LANES = 12

SHAPES = {"w": (96, 40), "b": (37,), "e": (50, 8)}


def global_tensor(name: str, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(sorted(SHAPES).index(name))
    return torch.randn(SHAPES[name], generator=g) + step


def make_state(rank: int, world: int, step: int, zero: bool = False) -> dict:
    layouts = {"w": Shard(0), "b": Replicate(), "e": Shard(0)}
    state = {}
    for n, lay in layouts.items():
        t = global_tensor(n, step)
        state[n] = ShardedTensor.from_global(torch.zeros_like(t) if zero else t, lay, rank, world)
    per = LANES // world
    state["data"] = ByLane({str(l): {"doc": -1 if zero else 100 * step + l} for l in range(rank * per, (rank + 1) * per)})
    state["meta"] = {"step": -1 if zero else step}
    return state
