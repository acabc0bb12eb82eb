"""The state a benchmark saves. ``sharded``: ``{"model": {name: piece}}``, one Shard(0)
piece per tensor. ``fsdp2``: what ``torch.distributed.checkpoint.state_dict.get_state_dict
(model, optim)`` returns for an FSDP2 model trained with AdamW, built from the same
pieces: the tensors in threes are a parameter and its ``exp_avg`` and ``exp_avg_sq``
(``Shard(0)`` DTensors on a 1-D mesh, wrapped by the library's saver), each parameter
with a plain 0-d ``step`` tensor, and ``param_groups`` with floats, bools, a tuple, None
and the parameter names. The bytes are the same in both; only the structure differs."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

STATE_KINDS = ("sharded", "fsdp2")
ROLES = ("param", "exp_avg", "exp_avg_sq")


def build_state(kind: str, local: dict[str, torch.Tensor], specs: Sequence[Any], wrap: Callable[[torch.Tensor, Any], Any]) -> dict:
    if kind == "sharded":
        return {"model": {s.name: wrap(local[s.name], s) for s in specs}}
    if kind != "fsdp2":
        raise ValueError(f"unknown state kind {kind!r}; expected one of {STATE_KINDS}")
    model: dict[str, Any] = {}
    state: dict[str, dict] = {}
    for i, s in enumerate(specs):
        fqn, role = f"layers.{i // 3}.weight", ROLES[i % 3]
        if role == "param":
            model[fqn] = wrap(local[s.name], s)
        else:
            state.setdefault(fqn, {"step": torch.tensor(float(i // 3))})[role] = wrap(local[s.name], s)
    groups = [{"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "amsgrad": False, "foreach": None,
               "maximize": False, "capturable": False, "differentiable": False, "fused": None,
               "decoupled_weight_decay": True, "params": list(model)}]
    return {"model": model, "optim": {"state": state, "param_groups": groups}}
