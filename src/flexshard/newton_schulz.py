"""Newton-Schulz orthogonalization, as ``torch.optim.Muon`` (torch 2.13) runs it, and what
it costs.

The operations, their order, dtypes and memory layouts are the same as torch's
``_zeropower_via_newtonschulz``, so a rank that owns a matrix produces the very bits a
single process would: cast to bf16 first, work on the wide orientation (transpose a tall
matrix), divide by the Frobenius norm (clamped below by ``eps``), then ``steps`` quintic
iterations ``X <- a X + (b A + c A^2) X`` with ``A = X X^T``, each an ``addmm``.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

DEFAULT_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
DEFAULT_STEPS = 5
DEFAULT_EPS = 1e-7


def orthogonalize(
    update: torch.Tensor,
    coefficients: tuple[float, float, float] = DEFAULT_COEFFICIENTS,
    steps: int = DEFAULT_STEPS,
    eps: float = DEFAULT_EPS,
) -> torch.Tensor:
    """The bf16 near-orthogonal factor of a 2-D ``update``. A bf16 input is worked on in
    place (as in torch, whose ``.bfloat16()`` is then a no-op)."""
    if update.ndim != 2:
        raise ValueError(f"Newton-Schulz needs a 2-D matrix, got shape {tuple(update.shape)}")
    if len(coefficients) != 3:
        raise ValueError(f"coefficients must be three floats (a, b, c), got {coefficients!r}")
    if not 0 <= steps < 100:
        raise ValueError(f"steps must be in [0, 100), got {steps}")
    a, b, c = coefficients
    x = update.bfloat16()
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x


def newton_schulz_flops(shape: Sequence[int], steps: int = DEFAULT_STEPS) -> int:
    """Multiply-add FLOPs (2 per multiply-add) of :func:`orthogonalize` on a matrix of
    ``shape``: per step ``X X^T`` (2 m^2 n), ``A A`` (2 m^3) and ``P X`` (2 m^2 n), with
    ``m <= n`` the short and long side. Element-wise work is left out."""
    if len(shape) != 2:
        raise ValueError(f"Newton-Schulz cost is defined for 2-D matrices, got shape {tuple(shape)}")
    m, n = sorted(int(s) for s in shape)
    return steps * (4 * m * m * n + 2 * m**3)


def adjust_lr(lr: float, adjust_lr_fn: str | None, shape: Sequence[int]) -> float:
    """Muon's shape-dependent learning rate (torch's ``_adjust_lr``): ``"original"`` (the
    default) scales by ``sqrt(max(1, rows / cols))``, ``"match_rms_adamw"`` by
    ``0.2 * sqrt(max(rows, cols))``."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, rows / cols))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(rows, cols))
    else:
        ratio = 1.0
    return lr * ratio
