"""Muon's per-matrix update, split where a sharded optimizer needs to split it.

``torch.optim.Muon`` (torch 2.13) does, per matrix and in this order::

    buf.lerp_(grad, 1 - momentum)                       # note: lerp, not mu*buf + grad
    update = grad.lerp(buf, momentum) if nesterov else buf
    ortho = newton_schulz(update)                        # bf16
    param.mul_(1 - lr * weight_decay)                    # decoupled decay, plain lr
    param.add_(ortho, alpha=-adjust_lr(lr, shape))       # shape-adjusted lr

The first two lines are element-wise (any piece of the matrix can run them); the
orthogonalization needs the whole matrix; the last two are element-wise again.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from flexshard.newton_schulz import DEFAULT_COEFFICIENTS, DEFAULT_EPS, DEFAULT_STEPS, adjust_lr, orthogonalize

ADJUST_LR_FNS = (None, "original", "match_rms_adamw")


@dataclass(frozen=True)
class MuonConfig:
    """Hyper-parameters of ``torch.optim.Muon``, with its defaults."""

    lr: float = 1e-3
    weight_decay: float = 0.1
    momentum: float = 0.95
    nesterov: bool = True
    ns_coefficients: tuple[float, float, float] = DEFAULT_COEFFICIENTS
    eps: float = DEFAULT_EPS
    ns_steps: int = DEFAULT_STEPS
    adjust_lr_fn: str | None = None

    def __post_init__(self) -> None:
        for name in ("lr", "weight_decay", "momentum"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"MuonConfig.{name} must be a float >= 0, got {value!r}")
        if self.adjust_lr_fn not in ADJUST_LR_FNS:
            raise ValueError(f"MuonConfig.adjust_lr_fn must be one of {ADJUST_LR_FNS}, got {self.adjust_lr_fn!r}")
        if not isinstance(self.ns_steps, int) or not 0 <= self.ns_steps < 100:
            raise ValueError(f"MuonConfig.ns_steps must be an int in [0, 100), got {self.ns_steps!r}")
        if len(self.ns_coefficients) != 3:
            raise ValueError(f"MuonConfig.ns_coefficients must be three floats, got {self.ns_coefficients!r}")


def momentum_update(grad: torch.Tensor, momentum_buffer: torch.Tensor, cfg: MuonConfig) -> torch.Tensor:
    """Advance the momentum buffer in place; return the (Nesterov) update to orthogonalize.
    Element-wise: a piece of the matrix gives the same bits as the whole."""
    momentum_buffer.lerp_(grad, 1 - cfg.momentum)
    return grad.lerp(momentum_buffer, cfg.momentum) if cfg.nesterov else momentum_buffer


def apply_update(param: torch.Tensor, ortho: torch.Tensor, global_shape: Sequence[int], cfg: MuonConfig) -> None:
    """Weight decay, then the orthogonalized step with the lr adjusted for the matrix's
    (global) shape. Element-wise: ``param`` and ``ortho`` may be matching pieces."""
    param.mul_(1 - cfg.lr * cfg.weight_decay)
    param.add_(ortho, alpha=-adjust_lr(cfg.lr, cfg.adjust_lr_fn, global_shape))


def muon_step_(param: torch.Tensor, grad: torch.Tensor, momentum_buffer: torch.Tensor, cfg: MuonConfig) -> None:
    """One Muon step on a whole matrix, in place."""
    update = momentum_update(grad, momentum_buffer, cfg)
    ortho = orthogonalize(update, cfg.ns_coefficients, cfg.ns_steps, cfg.eps)
    apply_update(param, ortho, tuple(param.shape), cfg)
