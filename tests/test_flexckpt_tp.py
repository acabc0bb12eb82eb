"""FSDP x tensor parallel state built the way torchtitan builds it (``parallelize_module``
with ``ColwiseParallel``/``RowwiseParallel``/``SequenceParallel`` on the ``tp`` sub-mesh,
then ``fully_shard`` on the ``fsdp`` sub-mesh of a (2, 2) mesh), and expert weights on an
``(efsdp, ep)`` mesh built the way torchtitan 0.3.0 builds them (``Shard(0)`` on ``ep``,
then ``fully_shard`` on ``efsdp``: ``(_StridedShard(0, sf=ep), Shard(0))``, or
``(Shard(1), Shard(0))`` when ``efsdp * ep`` exceeds the experts), on real gloo groups:
saved with zero collectives, loaded at (fsdp 4) and (tp 4) with experts at ep 1 and ep 4
at W=4, at (fsdp 2) with ep 2 at W=2 (ranks 0 and 1 of the launch, on a group of their
own) and as plain tensors at W=1, bit for bit equal to the saved ``full_tensor()`` and to
what ``dcp.load`` gives for the same save and target. One launch of 4 ranks (the W=1
loads run in the test process)."""
import torch
import torch.distributed as dist
from torch import nn

from flexckpt import Checkpointer
from flexshard import MeshLayout
from flexshard.spawn import run_workers
from collective_counts import communication, install_counters
from fsdp_states import _full, _same

VOCAB, DIM, HIDDEN = 10, 6, 7  # 7 rows over tp 2 then fsdp 2: 4 + 3, then 2 + 2 and 2 + 1


class Tiny(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.tok = nn.Embedding(VOCAB, DIM)
        self.norm = nn.RMSNorm(DIM)
        self.wq = nn.Linear(DIM, HIDDEN, bias=False)
        self.wo = nn.Linear(HIDDEN, DIM, bias=False)


class Experts(nn.Module):
    """One MoE layer's routed experts, a weight per projection, experts along dim 0."""

    def __init__(self, seed: int, experts: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.w1 = nn.Parameter(torch.randn(experts, 4, 8))  # dim 1 even: FSDP refuses an uneven dim 1
        self.w2 = nn.Parameter(torch.randn(experts, 8, 4))


# at (efsdp 2, ep 2): 4 experts are sharded on dim 0 by both (strided), 2 on dim 1 by efsdp
# (efsdp * ep = 4 > 2). torchtitan needs ep to divide the experts: 2 experts never go to ep 4.
EXPERTS = {"routed": 4, "few": 2}


def _expert_meshes(shape: tuple) -> dict:
    """Each expert module's (efsdp, ep) mesh at a target: ``shape``'s, in rank order,
    except that 2 experts at ep 4 (not a torchtitan layout) go to (efsdp 2, ep 2) with the
    rank table transposed (other ranks hold other pieces than at the save)."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    names = ("efsdp", "ep")
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    out = {}
    for name, n in EXPERTS.items():
        if n % shape[1]:
            out[name] = DeviceMesh("cpu", torch.arange(4).view(2, 2).t(), mesh_dim_names=names)
        else:
            out[name] = mesh
    return out


def _build_experts(seed: int, meshes):
    """torchtitan 0.3.0's order: ``ExpertParallel`` distributes each expert weight
    ``Shard(0)`` on the ``ep`` sub-mesh, then ``fully_shard`` on ``efsdp`` shards dim 0, or
    dim 1 when ``efsdp * ep > experts`` (its ``shard_placement_fn``, torchtitan #1561).
    ``meshes``: one (efsdp, ep) mesh for every module, or a mesh per module."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    layer = nn.ModuleDict({name: Experts(seed + i, n) for i, (name, n) in enumerate(EXPERTS.items())})
    for key, m in layer.items():
        mesh = meshes[key] if isinstance(meshes, dict) else meshes
        efsdp, ep = mesh.shape
        for name, p in list(m.named_parameters()):
            m.register_parameter(name, nn.Parameter(distribute_tensor(p.data, mesh["ep"], [Shard(0)])))
        dim = 1 if efsdp * ep > m.w1.shape[0] else 0
        fully_shard(m, mesh=mesh["efsdp"], shard_placement_fn=lambda _p, dim=dim: Shard(dim))
    return layer, torch.optim.AdamW(layer.parameters(), lr=1e-2)


def _build(seed: int, mesh_shape: tuple, names: tuple, mesh=None):
    """torchtitan's order: TP on the tp sub-mesh, then FSDP on the fsdp sub-mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    model = Tiny(seed)
    if mesh is None:
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    names = mesh.mesh_dim_names
    if "tp" in names:
        parallelize_module(model, mesh["tp"], {
            "tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "wq": ColwiseParallel(input_layouts=Shard(1)),
            "wo": RowwiseParallel(output_layouts=Replicate()),
        })
    if "fsdp" in names:
        fully_shard(model, mesh=mesh["fsdp"])
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optim


def _step(model, optim, seed: int) -> None:
    """One AdamW step on made-up gradients (each a function of its parameter, computed on
    the local pieces): the optimizer state exists and the weights move, with no forward."""
    with torch.no_grad():
        for p in model.parameters():
            p.grad = p.detach().clone().mul_(0.5).add_(seed)
    optim.step()
    optim.zero_grad()


def _state(model, optim, moe=None) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optim)
    if moe is None:
        return {"model": msd, "optim": osd}
    emsd, eosd = get_state_dict(*moe)
    return {"model": msd, "optim": osd, "moe": {"model": emsd, "optim": eosd}}


# dense target, and the experts' (efsdp, ep) at the same W=4 (efsdp = 4 // ep, as torchtitan)
TARGETS = {"fsdp4": ((4,), ("fsdp",), (4, 1)), "tp4": ((4,), ("tp",), (1, 4))}


def _built(seed: int, mesh_shape: tuple, names: tuple, experts: tuple, step: int) -> dict:
    """A target's state (dense and experts) after one step: the optimizer state exists
    before a load, as a resumed trainer's does."""
    model, optim = _build(seed, mesh_shape, names)
    moe = _build_experts(seed + 10, _expert_meshes(experts))
    for m, o in ((model, optim), moe):
        _step(m, o, step)
    return _state(model, optim, moe)


def _load_at_two(rank: int, url: str, dcp_dir: str) -> tuple | None:
    """W=2 inside the 4-rank launch: ranks 0 and 1, on a group of their own, load at
    (fsdp 2) with experts at (efsdp 1, ep 2); ranks 2 and 3 only make the groups."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    halves = init_device_mesh("cpu", (2, 2), mesh_dim_names=("half", "fsdp"))
    experts = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("half", "efsdp", "ep"))
    group = dist.new_group([0, 1])  # every rank makes it; ranks 2 and 3 are not in it
    if rank >= 2:
        return None
    states = []
    for _ in range(2):
        model, optim = _build(1, (), (), mesh=halves["fsdp"])
        moe = _build_experts(11, experts["efsdp", "ep"])
        for m, o in ((model, optim), moe):
            _step(m, o, 2)
        states.append(_state(model, optim, moe))
    ours, dcps = states
    with Checkpointer(url, run_id="loadw2", process_group=group) as ck:
        ck.load(ours)
    dcp.load(dcps, checkpoint_id=dcp_dir, process_group=group)
    return _full(ours), _full(dcps)


def _save_and_load(rank: int, world: int, url: str, dcp_dir: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    model, optim = _build(0, (2, 2), ("fsdp", "tp"))
    moe = _build_experts(10, init_device_mesh("cpu", (2, 2), mesh_dim_names=("efsdp", "ep")))
    for m, o in ((model, optim), moe):
        _step(m, o, 1)
    state = _state(model, optim, moe)
    placements = {k: tuple(map(str, v.placements)) for k, v in state["model"].items()}
    placements.update({f"moe/{k}": tuple(map(str, v.placements)) for k, v in state["moe"]["model"].items()})
    saved = _full(state)
    with Checkpointer(url, run_id="tp") as ck:
        counts = install_counters()
        h = ck.save(1, state)
        h.wait_staged()
        h.result(timeout=60)
        calls = communication(counts)
    dcp.save(state, checkpoint_id=dcp_dir)
    out = {"placements": placements, "calls": calls, "saved": saved}
    for target, (mesh_shape, names, experts) in TARGETS.items():
        ours, dcps = (_built(1, mesh_shape, names, experts, 2) for _ in range(2))
        with Checkpointer(url, run_id=f"load{target}") as ck:
            ck.load(ours)
        dcp.load(dcps, checkpoint_id=dcp_dir)
        out[target] = (_full(ours), _full(dcps))
    out["w2"] = _load_at_two(rank, url, dcp_dir)
    dist.barrier()
    return out


def test_fsdp_tp_and_expert_state_saves_with_no_collective_and_reshards_to_fsdp_tp_ep_and_plain_like_dcp(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    url, dcp_dir = str(tmp_path / "flex"), str(tmp_path / "dcp")
    results = run_workers(_save_and_load, 4, url, dcp_dir, timeout=240)
    first = results[0]
    # the placements the issue found in torchtitan's own state dict
    assert first["placements"]["tok.weight"] == ("_S(0, 2)", "S(0)")
    assert first["placements"]["wq.weight"] == ("_S(0, 2)", "S(0)")
    assert first["placements"]["wo.weight"] == ("S(0)", "S(1)")
    assert first["placements"]["norm.weight"] == ("S(0)", "R")
    # torchtitan 0.3.0's expert placements on (efsdp 2, ep 2)
    assert first["placements"]["moe/routed.w1"] == ("_S(0, 2)", "S(0)")
    assert first["placements"]["moe/few.w2"] == ("S(1)", "S(0)")
    saved = first["saved"]
    assert {k for k in saved if k.startswith("/moe/model/")} == {f"/moe/model/{e}.{w}" for e in EXPERTS for w in ("w1", "w2")}
    assert sum(k.startswith("/moe/optim/state/") for k in saved) == 12  # step, exp_avg, exp_avg_sq per expert weight
    for rank, r in enumerate(results):
        assert r["calls"] == {}, (rank, r["calls"])  # zero collectives on save, 2-D and expert state included
        assert _same(saved, r["saved"]) == []
        for target in [*TARGETS, "w2"]:
            if target == "w2" and rank >= 2:
                assert r[target] is None
                continue
            ours, dcps = r[target]
            assert _same(saved, ours) == [], (target, rank)
            assert _same(dcps, ours) == [], (target, rank)
    with Checkpointer(url) as ck:
        layouts = {n: t.layout for n, t in ck.contents().by_name().tensors.items()}
    assert layouts["model/wo.weight"] == MeshLayout((2, 2), ("S0", "S1"))
    assert layouts["model/wq.weight"] == MeshLayout((2, 2), ("SS0:2", "S0"))
    assert layouts["moe/model/routed.w1"] == MeshLayout((2, 2), ("SS0:2", "S0"))
    assert layouts["moe/model/few.w2"] == MeshLayout((2, 2), ("S1", "S0"))

    # W=1, plain tensors, in this process: flexckpt and dcp.load agree with the saved tensors
    states = []
    for _ in range(2):
        m, layer = Tiny(1), nn.ModuleDict({name: Experts(11 + i, n) for i, (name, n) in enumerate(EXPERTS.items())})
        o, lo = torch.optim.AdamW(m.parameters(), lr=1e-2), torch.optim.AdamW(layer.parameters(), lr=1e-2)
        _step(m, o, 2)
        _step(layer, lo, 2)
        msd, osd = get_state_dict(m, o)
        emsd, eosd = get_state_dict(layer, lo)
        states.append({"model": msd, "optim": osd, "moe": {"model": emsd, "optim": eosd}})
    with Checkpointer(url, rank=0, world_size=1, run_id="plain") as ck:
        ck.load(states[0])
    dcp.load(states[1], checkpoint_id=dcp_dir)
    assert _same(saved, _full(states[0])) == []
    assert _same(_full(states[1]), _full(states[0])) == []
