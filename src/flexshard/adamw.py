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


def adamw_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: int,
    cfg: AdamWConfig,
) -> None:
    """Step number ``step`` (1 for the first) on ``param`` in place."""
    beta1, beta2 = cfg.betas
    if cfg.weight_decay != 0:
        param.mul_(1 - cfg.lr * cfg.weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    t = float(step)  # torch keeps the step as a float32 tensor and reads it with .item()
    bias_correction1 = 1 - beta1**t
    bias_correction2 = 1 - beta2**t
    step_size = cfg.lr / bias_correction1
    denom = (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(cfg.eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)
