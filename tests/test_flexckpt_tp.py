"""FSDP x tensor parallel state built the way torchtitan builds it (``parallelize_module``
with ``ColwiseParallel``/``RowwiseParallel``/``SequenceParallel`` on the ``tp`` sub-mesh,
then ``fully_shard`` on the ``fsdp`` sub-mesh of a (2, 2) mesh), on real gloo groups:
saved with zero collectives, loaded at (fsdp 4) and (tp 4) at W=4 and as plain tensors at
W=1, bit for bit equal to the saved ``full_tensor()`` and to what ``dcp.load`` gives for
the same save and target. One launch of 4 ranks (the W=1 loads run in the test process)."""
import torch
import torch.distributed as dist
from torch import nn

from flexckpt import Checkpointer
from flexshard import MeshLayout
from flexshard.spawn import run_workers
from test_flexckpt_distributed import communication, install_counters
from test_flexckpt_dtensor import _full, _same

VOCAB, DIM, HIDDEN = 10, 6, 7  # 7 rows over tp 2 then fsdp 2: 4 + 3, then 2 + 2 and 2 + 1


class Tiny(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.tok = nn.Embedding(VOCAB, DIM)
        self.norm = nn.RMSNorm(DIM)
        self.wq = nn.Linear(DIM, HIDDEN, bias=False)
        self.wo = nn.Linear(HIDDEN, DIM, bias=False)



def _build(seed: int, mesh_shape: tuple, names: tuple):
    """torchtitan's order: TP on the tp sub-mesh, then FSDP on the fsdp sub-mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    model = Tiny(seed)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
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


def _state(model, optim) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optim)
    return {"model": msd, "optim": osd}


TARGETS = {"fsdp4": ((4,), ("fsdp",)), "tp4": ((4,), ("tp",))}


def _save_and_load(rank: int, world: int, url: str, dcp_dir: str) -> dict:
    import torch.distributed.checkpoint as dcp

    model, optim = _build(0, (2, 2), ("fsdp", "tp"))
    _step(model, optim, 1)
    state = _state(model, optim)
    placements = {k: tuple(map(str, v.placements)) for k, v in state["model"].items()}
    saved = _full(state)
    with Checkpointer(url, run_id="tp") as ck:
        counts = install_counters()
        h = ck.save(1, state)
        h.wait_staged()
        h.result(timeout=60)
        calls = communication(counts)
    dcp.save(state, checkpoint_id=dcp_dir)
    out = {"placements": placements, "calls": calls, "saved": saved}
    for target, (mesh_shape, names) in TARGETS.items():
        mine, theirs = _build(1, mesh_shape, names), _build(1, mesh_shape, names)
        for m, o in (mine, theirs):
            _step(m, o, 2)  # the optimizer state exists before a load, as a resumed trainer's does
        ours, dcps = _state(*mine), _state(*theirs)
        with Checkpointer(url, run_id=f"load{target}") as ck:
            ck.load(ours)
        dcp.load(dcps, checkpoint_id=dcp_dir)
        out[target] = (_full(ours), _full(dcps))
    dist.barrier()
    return out


def test_fsdp_tp_state_saves_with_no_collective_and_reshards_to_fsdp_tp_and_plain_like_dcp(tmp_path):
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
    saved = first["saved"]
    for rank, r in enumerate(results):
        assert r["calls"] == {}, (rank, r["calls"])  # zero collectives on save, 2-D state included
        assert _same(saved, r["saved"]) == []
        for target in TARGETS:
            ours, dcps = r[target]
            assert _same(saved, ours) == [], (target, rank)
            assert _same(dcps, ours) == [], (target, rank)
    with Checkpointer(url) as ck:
        layouts = {n: t.layout for n, t in ck.contents().tensors.items()}
    assert layouts["model/wo.weight"] == MeshLayout((2, 2), ("S0", "S1"))
    assert layouts["model/wq.weight"] == MeshLayout((2, 2), ("SS0:2", "S0"))

    # W=1, plain tensors, in this process: flexckpt and dcp.load agree with the saved tensors
    plain = [Tiny(1), Tiny(1)]
    states = []
    for m in plain:
        o = torch.optim.AdamW(m.parameters(), lr=1e-2)
        _step(m, o, 2)
        msd, osd = get_state_dict(m, o)
        states.append({"model": msd, "optim": osd})
    with Checkpointer(url, rank=0, world_size=1, run_id="plain") as ck:
        ck.load(states[0])
    dcp.load(states[1], checkpoint_id=dcp_dir)
    assert _same(saved, _full(states[0])) == []
    assert _same(_full(states[1]), _full(states[0])) == []
