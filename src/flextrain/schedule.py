"""Learning rate by step: linear warmup, then cosine or linear decay to a floor."""
from __future__ import annotations

import math


def lr_scale(step: int, total: int, warmup: int, decay: str, min_ratio: float) -> float:
    """Multiplier of the base learning rates for optimizer step ``step`` (0-based)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if decay == "cosine" else 1 - progress
    return min_ratio + (1 - min_ratio) * shape
