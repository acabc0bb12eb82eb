"""DTensor state dicts (FSDP2 ``fully_shard``, ``distribute_tensor``, ``get_state_dict``)
saved and loaded by flexckpt on real gloo groups: an FSDP2 model trained with AdamW at
world 2, loaded at worlds 1, 2 and 4 bit-identical, training resumed bit-identical, zero
collectives on save, and the placements that are refused in ``save()``; HSDP DTensors saved
at 4 and loaded at 1. Two launches (2 and 4 ranks) and a group of one rank in the test
process, shared by the tests."""
import pytest
import torch
import torch.distributed as dist

import flexshard
from flexckpt import Checkpointer
from flexshard import Shard, ShardedTensor
from scenario_group import run_scenarios
from collective_counts import communication, install_counters
from fsdp_states import _fresh_state, _fsdp, _full, _same, _train

STEP = 3


class _Stateful:
    """torchtitan's way: model and optimizer behind state_dict()/load_state_dict()."""

    def __init__(self, get, set_) -> None:
        self.get, self.set = get, set_

    def state_dict(self) -> dict:
        return self.get()

    def load_state_dict(self, sd: dict) -> None:
        self.set(sd)


def _restore(url: str, world: int, stateful: bool = False) -> tuple:
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict, get_optimizer_state_dict, get_state_dict, set_model_state_dict,
        set_optimizer_state_dict, set_state_dict,
    )

    model, optim, state = _fresh_state(world)
    if stateful:
        state = {
            "model": _Stateful(lambda: get_model_state_dict(model), lambda sd: set_model_state_dict(model, sd)),
            "optim": _Stateful(lambda: get_optimizer_state_dict(model, optim),
                               lambda sd: set_optimizer_state_dict(model, optim, sd)),
            "step": -1,
        }
    with Checkpointer(url, run_id=f"load{world}") as ck:
        step = ck.load(state)
    if stateful:
        msd, osd = get_state_dict(model, optim)
        return model, optim, {"model": msd, "optim": osd, "step": state["step"]}, step
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return model, optim, state, step


def _refusals(rank: int, world: int, url: str) -> list[str]:
    """Messages of every refused DTensor, raised synchronously by save()."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor
    from torch.distributed.tensor import Shard as DShard
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = init_device_mesh("cpu", (world,))
    t = torch.arange(8 * 6, dtype=torch.float32).view(8, 6)
    cases = {  # Shard(1), 2-D (Shard(0), Shard(1)), meshes in another rank order and meshes spanning part
        # of the world (a pipeline stage's; tests/test_flexckpt_pipeline.py) are boxes now
        "partial": DTensor.from_local(t, mesh, [Partial()]),
        "strided": distribute_tensor(t, mesh, [_StridedShard(0, split_factor=2)]),
    }
    if world == 4:
        mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        if getattr(flexshard, "HybridShard", None) is None:
            cases["hsdp"] = distribute_tensor(t, mesh2, [Replicate(), DShard(0)])
    out = []
    with Checkpointer(url, run_id="refuse") as ck:
        for name, value in cases.items():
            with pytest.raises(ValueError) as e:
                ck.save(1, {"x": {name: value}})
            out.append(str(e.value))
    return out


def _chunk_equals_flexshard(rank: int, world: int) -> list[str]:
    """distribute_tensor's Shard(0) piece is flexshard's Shard(0) piece, for awkward sizes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor import Shard as DShard

    mesh = init_device_mesh("cpu", (world,))
    bad = []
    for shape in [(0, 3), (1,), (2, 3), (5,), (7, 2), (13, 7), (97, 5)]:
        t = torch.arange(max(1, torch.Size(shape).numel()), dtype=torch.float32)[: torch.Size(shape).numel()].view(shape)
        local = distribute_tensor(t, mesh, [DShard(0)]).to_local()
        want = ShardedTensor.from_global(t, Shard(0), rank, world).local
        if local.shape != want.shape or not torch.equal(local, want):
            bad.append(f"{shape}: DTensor {tuple(local.shape)} vs flexshard {tuple(want.shape)}")
    return bad


def _save_at_two(rank: int, world: int, url: str, st_url: str) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor import Shard as DShard
    from torch.distributed.device_mesh import init_device_mesh

    model, optim = _fsdp(world)
    _train(model, optim, rank, 0, STEP)
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd, "step": STEP}
    ck = Checkpointer(url, run_id="fsdp2")
    counts = install_counters()
    h = ck.save(STEP, state)
    h.wait_staged()
    h.result(timeout=60)
    save_calls = communication(counts)
    ck.close()
    saved = _full(state)
    _train(model, optim, rank, STEP, 3)
    uninterrupted = _full(get_state_dict(model, optim)[0])
    dist.barrier()  # test code: every rank's save is committed before the load below

    model2, optim2, state2, step = _restore(url, world)
    loaded = _full(state2)
    _train(model2, optim2, rank, STEP, 3)
    resumed = _full(get_state_dict(model2, optim2)[0])

    # the same tensor as a 1-D Shard(0) DTensor and as a ShardedTensor: identical manifests
    t = torch.arange(13 * 7, dtype=torch.float32).view(13, 7)
    mesh = init_device_mesh("cpu", (world,))
    for sub, value in (("dt", distribute_tensor(t, mesh, [DShard(0)])), ("st", ShardedTensor.from_global(t, Shard(0)))):
        with Checkpointer(f"{st_url}-{sub}", run_id="same") as c:
            c.save(1, {"w": value}).result(timeout=60)
    return {
        "save_calls": save_calls, "saved": saved, "uninterrupted": uninterrupted, "loaded": loaded,
        "resumed": resumed, "step": step, "refused": _refusals(rank, world, url + "-refused"),
    }


def _hsdp_mapping(rank: int, world: int) -> list[str]:
    """The HSDP mapping, against a stand-in with HybridShard's documented pieces (rank r
    holds what Shard(0) gives r % G in a world of G), until the real layout lands."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor import Shard as DShard

    from flexckpt.dtensor import dtensor_leaf

    class StandIn:
        def __init__(self, group_size: int, block_size: int | None = None) -> None:
            self.group_size = group_size

        def flat_range(self, shape, world_size, rank):
            return Shard(0).flat_range(shape, self.group_size, rank % self.group_size)

    if getattr(flexshard, "HybridShard", None) is not None:
        return []
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    bad = []
    flexshard.HybridShard = StandIn
    try:
        for shape in [(13, 7), (1,), (5,), (0, 3)]:
            n = torch.Size(shape).numel()
            value = distribute_tensor(torch.arange(n, dtype=torch.float32).view(shape), mesh, [Replicate(), DShard(0)])
            local, layout, got_shape = dtensor_leaf(value, "w", rank, world)
            if not (local.data_ptr() == value.to_local().data_ptr() and layout.group_size == 2 and got_shape == shape):
                bad.append(str(shape))
    finally:
        del flexshard.HybridShard
    return bad


def _cross_load(rank: int, world: int, st_url: str) -> list[str]:
    """The ShardedTensor save into a DTensor target, the DTensor save into a plain tensor."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor import Shard as DShard

    t = torch.arange(13 * 7, dtype=torch.float32).view(13, 7)
    mesh = init_device_mesh("cpu", (world,))
    into_dt = {"w": distribute_tensor(torch.zeros(13, 7), mesh, [DShard(0)])}
    into_plain = {"w": torch.zeros(13, 7)}
    with Checkpointer(f"{st_url}-st", run_id="x1") as a, Checkpointer(f"{st_url}-dt", run_id="x2") as b:
        a.load(into_dt)
        b.load(into_plain)
    return [k for k, ok in (("into DTensor", torch.equal(into_dt["w"].full_tensor(), t)),
                            ("into plain", torch.equal(into_plain["w"], t))) if not ok]


def _load_at(rank: int, world: int, url: str, st_url: str) -> dict:
    _model2, _optim2, state, step = _restore(url, world, stateful=world == 4)
    return {"cross": _cross_load(rank, world, st_url),"loaded": _full(state), "step": step, "chunks": _chunk_equals_flexshard(rank, world),
            "refused": _refusals(rank, world, url + "-refused") if world == 4 else [],
            "hsdp": _hsdp_mapping(rank, world) if world == 4 else []}


HAS_HSDP = getattr(flexshard, "HybridShard", None) is not None


def _in_a_group_of_one(scenarios: list) -> dict:
    """World 1 in this process, on a gloo group of one rank, gone after (a launch of one
    process would cost it a torch import): ``{name: [result]}`` as ``run_scenarios`` gives."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        return {name: [fn(0, 1, *args)] for name, fn, args in scenarios}
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Two launches: 2 ranks save the FSDP2 state (and check the leaf cache); 4 ranks load it
    and save the HSDP state; then this process loads both at world 1."""
    tmp = tmp_path_factory.mktemp("dtensor")
    url, st_url, hsdp_url = str(tmp / "fsdp2"), str(tmp / "same"), str(tmp / "hsdp")
    hsdp_save = [("hsdp save", _hsdp_save, (hsdp_url,))] if HAS_HSDP else []
    hsdp_load = [("hsdp load", _hsdp_load, (hsdp_url,))] if HAS_HSDP else []
    return {
        2: run_scenarios(2, [("save", _save_at_two, (url, st_url)), ("leaf cache", _leaf_cache, ())], timeout=180),
        4: run_scenarios(4, [("load", _load_at, (url, st_url)), *hsdp_save], timeout=180),
        1: _in_a_group_of_one([("load", _load_at, (url, st_url)), *hsdp_load]),
        "urls": (url, st_url, hsdp_url),
    }


def test_fsdp2_adamw_state_saved_at_two_loads_at_one_two_four_and_resumes_bit_identical(launched):
    url, st_url, _ = launched["urls"]
    two = launched[2]["save"]
    saved = two[0]["saved"]
    assert saved["/step"] == STEP and any(k.endswith("exp_avg_sq") for k in saved)
    assert saved["/optim/param_groups/0/betas/1"] == 0.999 and saved["/optim/param_groups/0/foreach"] is None
    for rank, r in enumerate(two):
        assert r["save_calls"] == {}, (rank, r["save_calls"])  # zero collectives on save
        assert r["step"] == STEP
        assert _same(saved, r["saved"]) == []
        assert _same(saved, r["loaded"]) == []
        assert _same(r["uninterrupted"], r["resumed"]) == []
    assert not torch.equal(two[0]["uninterrupted"]["/0.weight"], saved["/model/0.weight"])  # training moved on

    with Checkpointer(f"{st_url}-dt") as a, Checkpointer(f"{st_url}-st") as b:
        assert a.contents().tensors == b.contents().tensors
        assert a.contents().tensors[("w",)].layout == Shard(0)

    for world in (1, 4):
        for r in launched[world]["load"]:
            assert r["step"] == STEP and r["chunks"] == [] and r["hsdp"] == [] and r["cross"] == []
            assert _same(saved, r["loaded"]) == []

    refused = two[0]["refused"] + r["refused"]
    assert [m.split("'")[1] for m in refused] == [
        "x/partial", "x/strided", "x/partial", "x/strided",
    ] + (["x/hsdp"] if getattr(flexshard, "HybridShard", None) is None else [])
    assert "Partial" in refused[0] and "redistribute it first" in refused[0]
    assert "_StridedShard" in refused[1] and "strided set of indices" in refused[1]


HSDP = {"a": (13, 7), "b": (5,), "c": (64, 3)}


def _hsdp_tensor(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(len(name) * 7 + ord(name[0]))
    return torch.randn(HSDP[name], generator=g)


def _hsdp_save(rank: int, world: int, url: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor import Shard as DShard

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    state = {n: distribute_tensor(_hsdp_tensor(n), mesh, [Replicate(), DShard(0)]) for n in HSDP}
    with Checkpointer(url, run_id="hsdp") as ck:  # construction may broadcast once (the session)
        counts = install_counters()
        h = ck.save(1, state)
        h.wait_staged()
        h.result(timeout=60)
        calls = communication(counts)
    return {"calls": calls}


def _hsdp_load(rank: int, world: int, url: str) -> list[str]:
    """Load into 1-D Shard(0) DTensors at this world; compare with the global tensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor import Shard as DShard

    mesh = init_device_mesh("cpu", (world,))
    target = {n: distribute_tensor(torch.zeros(HSDP[n]), mesh, [DShard(0)]) for n in HSDP}
    with Checkpointer(url, run_id="hsdpload") as ck:
        ck.load(target)
    return [n for n in HSDP if not torch.equal(target[n].full_tensor(), _hsdp_tensor(n))]


@pytest.mark.skipif(not HAS_HSDP, reason="needs flexshard.HybridShard (issue 'flexckpt at 16,384 ranks')")
def test_hsdp_dtensors_on_a_two_by_two_mesh_saved_at_four_load_at_one(launched):
    assert all(r["calls"] == {} for r in launched[4]["hsdp save"])
    assert launched[1]["hsdp load"] == [[]]
    with Checkpointer(launched["urls"][2]) as ck:
        assert ck.contents().tensors[("a",)].layout == flexshard.HybridShard(2)


def _leaf_cache(rank: int, world: int) -> list:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard as DShard

    from flexckpt.dtensor import _LEAVES
    from flexckpt.structure import walk

    mesh = init_device_mesh("cpu", (world,))
    dt = DTensor.from_local(torch.arange(6.0).reshape(3, 2) + 10 * rank, mesh, [DShard(0)], run_check=False)
    first, again = walk({"w": dt}, rank, world), walk({"w": dt}, rank, world)
    out = [first.key == again.key, again.tensors[0] is dt._local_tensor, id(dt) in _LEAVES]
    dt._local_tensor = torch.zeros(2, 2)  # the local piece swapped for one of another shape: mapped again
    try:
        walk({"w": dt}, rank, world)
        out.append("no error")
    except Exception as e:  # noqa: BLE001 - the message travels back to the test
        out.append(str(e))
    return out


def test_a_dtensor_seen_again_maps_at_once_and_a_changed_local_piece_is_mapped_again(launched):
    for same_key, same_local, cached, refusal in launched[2]["leaf cache"]:
        assert same_key and same_local and cached
        assert "local tensor has shape [2, 2]" in refusal and "piece of shape [3, 2] of [6, 2]" in refusal


_LATE_IMPORT = r"""
import sys, tempfile
import torch
import torch.distributed as dist
import flexckpt
from flexckpt.structure import walk
assert "torch.distributed.tensor" not in sys.modules, "import flexckpt pulled in torch.distributed.tensor"
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
store = dist.FileStore(tempfile.mktemp(), 1)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
w = walk({"w": distribute_tensor(torch.arange(6.0).reshape(3, 2), mesh, [Shard(0)])}, 0, 1)
print([s.to_json()["layout"] for s in w.specs], w.tensors[0].tolist())
dist.destroy_process_group()
"""


def test_flexckpt_leaves_torch_distributed_tensor_unimported_and_knows_a_dtensor_made_after():
    """``import flexckpt`` must not import torch.distributed.tensor (sympy: 1.5-2 s of CPU in
    every process); a DTensor made after it is still walked as one (its local piece, Shard(0))."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _LATE_IMPORT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[{'kind': 'shard', 'dim': 0}] [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]"
