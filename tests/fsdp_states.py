"""FSDP2 training states for the DTensor, tensor-parallel and converter tests: a small model
sharded with fully_shard, trained a few steps, its state dict gathered whole and compared."""
import torch
from torch import nn

SIZES = [(13, 7), (7, 5), (5, 3)]  # awkward on purpose: 13 rows over 4 ranks is 4, 4, 4, 1


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(i, o) for i, o in SIZES])


def _fsdp(world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = _model()
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, optim


def _train(model, optim, rank: int, first: int, steps: int) -> None:
    for step in range(first, first + steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(8, SIZES[0][0], generator=g)
        loss = model(x).square().mean()
        loss.backward()
        optim.step()
        optim.zero_grad()


def _full(sd: dict) -> dict:
    """Every tensor of a (model, optim) state dict pair, gathered whole (test code only)."""
    out = {}

    def visit(prefix: str, value) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                visit(f"{prefix}/{k}", v)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                visit(f"{prefix}/{i}", v)
        elif hasattr(value, "full_tensor"):
            out[prefix] = value.full_tensor().clone()
        elif isinstance(value, torch.Tensor):
            out[prefix] = value.clone()
        else:
            out[prefix] = value

    visit("", sd)
    return out


def _fresh_state(world: int):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optim = _fsdp(world)
    msd, osd = get_state_dict(model, optim)
    return model, optim, {"model": msd, "optim": osd, "step": -1}


def _same(a: dict, b: dict) -> list[str]:
    bad = [k for k in a if k not in b]
    for k, v in a.items():
        if k in b and (not torch.equal(v, b[k]) if isinstance(v, torch.Tensor) else v != b[k]):
            bad.append(k)
    return bad
