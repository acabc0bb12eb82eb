"""Read once, fan out (issue 29) for experts: an MoE-like state at W=4 over a spawned gloo
group, its expert weights sharded over the expert-parallel dim of a 2-D (dp 2, ep 2) mesh
and replicated over the data-parallel one, its dense part replicated on every rank. Loaded
with fan-out forced and without: bit-exact, each stored byte read from the store once, and
each rank's store plus peer bytes what it read alone. (flexshard layouts, not DTensors: the
fan-out sees the saved layout only, DTensor capture of EP meshes is test_mesh_layouts' and
test_tensor_parallel's; DTensors would triple this test's time on 2 cores.)"""
from __future__ import annotations

import math

# name: (shape, placements on the 2x2 mesh); None: a plain tensor, replicated on all 4 ranks.
# experts.w1: torchtitan's order (dp outer, ep inner: replicas are ranks r and r + 2), 3
# experts over ep 2 (uneven: 2 and 1); experts.w2: ep outer (replicas are consecutive ranks).
# Every piece is at least chunk_bytes (512): chunks of its own, none shared by two tensors.
STATE = {
    "experts.w1": ((3, 8, 16), ("R", "S0")),
    "experts.w2": ((4, 16, 8), ("S0", "R")),
    "router.weight": ((4, 32), ("R", "R")),
    "norm.weight": ((128,), None),
}
REPLICAS = {"experts.w1": 2, "experts.w2": 2, "router.weight": 4, "norm.weight": 4}


def _moe_state(rank: int, world: int, zero: bool) -> dict:
    import torch

    from flexshard import MeshLayout, ShardedTensor

    g = torch.Generator().manual_seed(29)
    out = {}
    for name, (shape, codes) in STATE.items():
        t = torch.randn(shape, generator=g)
        if zero:
            t = torch.zeros_like(t)
        out[name] = t if codes is None else ShardedTensor.from_global(t, MeshLayout((2, 2), codes), rank=rank,
                                                                      world_size=world)
    return out


def _experts_worker(rank: int, world: int, url: str) -> dict:
    import torch

    from flexckpt import Checkpointer
    from flexckpt.catalog import read_manifest

    ck = Checkpointer(url, chunk_bytes=512)
    ck.save(1, _moe_state(rank, world, zero=False)).result(60)
    ck.close()
    want = _moe_state(rank, world, zero=False)
    out: dict = {}
    for fan in (False, True):
        state = _moe_state(rank, world, zero=True)
        ck = Checkpointer(url, fanout=fan)
        ck.load(state, step=1)
        s = ck.last_load_stats
        ck.close()
        local = lambda v: getattr(v, "local", v)  # noqa: E731
        exact = all(torch.equal(local(state[k]), local(want[k])) for k in want)
        out[fan] = {"exact": exact, "store": s.bytes_from_store - s.metadata_bytes, "peers": s.bytes_from_peers}
    m = read_manifest(Checkpointer(url, read_only=True).storage, 1)
    out["needed"] = sum(int(m.files[f].lengths.sum()) for f in m.files)
    out["chunk"] = max(int(m.files[f].lengths.max()) for f in m.files)
    return out


def test_experts_sharded_over_ep_and_replicated_over_dp_are_read_once(tmp_path):
    from flexshard.spawn import run_workers

    results = run_workers(_experts_worker, 4, str(tmp_path / "moe"), timeout=180)
    nbytes = {name: 4 * math.prod(shape) for name, (shape, _) in STATE.items()}  # float32, uncompressed
    needed = results[0]["needed"]
    assert needed == sum(nbytes.values())  # every stored byte is one tensor's: none padding
    off = [r[False] for r in results]
    on = [r[True] for r in results]
    assert all(x["exact"] for x in off + on)
    # read once with fan-out; without, each replica reads its own: the experts twice, the dense part 4 times
    assert sum(x["store"] for x in on) == needed
    assert sum(x["store"] for x in off) == sum(REPLICAS[n] * b for n, b in nbytes.items())
    assert sum(x["peers"] for x in off) == 0
    # what one rank did not read it received; no rank reads much more than total / W
    assert [x["store"] + x["peers"] for x in on] == [x["store"] for x in off]
    assert max(x["store"] for x in on) <= needed / 4 + 4 * results[0]["chunk"]
