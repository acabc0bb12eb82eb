"""AdamW's update, element-wise, as ``torch.optim.AdamW`` (torch 2.13, single-tensor path:
the one torch picks on CPU) runs it, so any piece of a tensor gives the same bits as the
whole."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AdamWConfig:
    """Hyper-parameters of ``torch.optim.AdamW``, with its defaults (no amsgrad/maximize)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 1e-2

    def __post_init__(self) -> None:
        for name in ("lr", "eps", "weight_decay"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"AdamWConfig.{name} must be a float >= 0, got {value!r}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"AdamWConfig.betas must be two floats in [0, 1), got {self.betas!r}")


# Elements per piece of the CPU update: the eight element-wise passes of one piece (five
# tensors of 128 KiB) stay in the core's L2 instead of streaming every tensor from memory
# eight times; a multiple of every vector width, so the bits are those of one whole pass.
CPU_CHUNK = 1 << 15


def adamw_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: int,
    cfg: AdamWConfig,
) -> None:
    """Step number ``step`` (1 for the first) on ``param`` in place (contiguous tensors of
    one shape). On the CPU it runs piece by piece (:data:`CPU_CHUNK` elements): the same
    element-wise operations in the same order, so the same bits."""
    beta1, beta2 = cfg.betas
    t = float(step)  # torch keeps the step as a float32 tensor and reads it with .item()
    bias_correction1 = 1 - beta1**t
    bias_correction2_sqrt = (1 - beta2**t) ** 0.5
    step_size = cfg.lr / bias_correction1
    n = param.numel()
    chunk = CPU_CHUNK if param.device.type == "cpu" else max(n, 1)
    flat = [x.view(-1) for x in (param, grad, exp_avg, exp_avg_sq)]
    denom = torch.empty(min(chunk, n), dtype=exp_avg_sq.dtype, device=exp_avg_sq.device)
    for start in range(0, n, chunk):
        p, g, m, v = (x[start : start + chunk] for x in flat)
        d = denom[: p.numel()]
        if cfg.weight_decay != 0:
            p.mul_(1 - cfg.lr * cfg.weight_decay)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        torch.sqrt(v, out=d)  # torch: (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        d.div_(bias_correction2_sqrt).add_(cfg.eps)
        p.addcdiv_(m, d, value=-step_size)
