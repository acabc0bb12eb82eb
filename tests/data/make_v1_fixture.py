"""How tests/data/v1 was made: run with the flexckpt of commit c0aceba (format version 1),
which no longer exists on this branch's writer. Kept for the record, not run by the tests.

    PYTHONPATH=src python tests/data/make_v1_fixture.py tests/data/v1
"""
import sys

import torch

from flexckpt import ByLane, Checkpointer, PerRank
from flexshard import BlockShard, Owned, Replicate, Shard, ShardedTensor


def global_tensors() -> dict:
    g = torch.Generator().manual_seed(7)
    return {
        "block": torch.randn(70, 3, generator=g),
        "shard": torch.randint(-1000, 1000, (9, 2), generator=g, dtype=torch.int64),
        "owned": torch.randn(5, 4, generator=g).to(torch.bfloat16),
        "rep": torch.arange(6, dtype=torch.float32),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
    }


LAYOUTS = {"block": BlockShard(32), "shard": Shard(0), "owned": Owned(1), "rep": Replicate(), "scalar": Replicate()}


def state(rank: int, world: int) -> dict:
    t = global_tensors()
    return {
        "t": {n: ShardedTensor.from_global(v, LAYOUTS[n], rank, world) for n, v in t.items()},
        "step": 3,
        "lanes": ByLane({str(rank): {"doc": 10 + rank}}),
        "rng": PerRank({"seed": 100 + rank}),
    }


if __name__ == "__main__":
    url = sys.argv[1]
    for compression, sub in ((None, "plain"), ("zstd", "zstd")):
        cps = [Checkpointer(f"{url}/{sub}", rank=r, world_size=2, run_id="v1fixture", compression=compression,
                            chunk_bytes=256, fsync=False) for r in range(2)]
        handles = [cp.save(3, state(r, 2)) for r, cp in enumerate(cps)]
        for h in handles:
            h.result(30)
        for cp in cps:
            cp.close()
