"""The on-disk format: version-1 checkpoints (made by the flexckpt of c0aceba, kept under
tests/data/v1) still load, at the saved world size and another."""
import importlib.util
import pathlib
import shutil

import pytest
import torch

from flexckpt import ByLane, Checkpointer, PerRank
from flexshard import BlockShard, ShardedTensor

DATA = pathlib.Path(__file__).parent / "data"
_spec = importlib.util.spec_from_file_location("make_v1_fixture", DATA / "make_v1_fixture.py")
fixture = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fixture)


def _empty_state(rank, world, layouts):
    g = fixture.global_tensors()
    return {
        "t": {n: ShardedTensor.empty(v.shape, layouts[n], dtype=v.dtype, rank=rank, world_size=world) for n, v in g.items()},
        "step": 0,
        "lanes": ByLane(),
        "rng": PerRank(None),
    }


@pytest.mark.parametrize("sub", ["plain", "zstd"])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_version_1_checkpoint_loads_at_any_world_size(tmp_path, sub, world):
    root = tmp_path / "ck"
    shutil.copytree(DATA / "v1" / sub, root)
    layouts = dict(fixture.LAYOUTS, owned=BlockShard(2))  # load into other layouts too
    want = fixture.global_tensors()
    for rank in range(world):
        state = _empty_state(rank, world, layouts)
        cp = Checkpointer(str(root), rank=rank, world_size=world, run_id="reader")
        assert cp.steps() == [3]
        assert cp.load(state) == 3
        for name, st in state["t"].items():
            expect = ShardedTensor.from_global(want[name], layouts[name], rank, world).local
            assert torch.equal(st.local, expect), name
        assert state["step"] == 3
        assert state["lanes"].values == {"0": {"doc": 10}, "1": {"doc": 11}}
        assert state["rng"].restored == (world == 2)
        if world == 2:
            assert state["rng"].value == {"seed": 100 + rank}
        cp.close()
