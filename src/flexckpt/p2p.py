"""Bytes over point-to-point sends: a buffer as the uint8 tensor gloo sends (no copy), and a
send or receive waited on with a timeout. Used by the fast tier's transport and the load's
read-once exchange."""
from __future__ import annotations

import datetime
import warnings

import numpy as np
import torch
import torch.distributed as dist


def wait(work: "dist.Work", timeout: float) -> None:
    """Wait for a posted send or receive; gloo raises after ``timeout`` seconds."""
    work.wait(datetime.timedelta(seconds=timeout))


def as_tensor(part: "bytes | memoryview | np.ndarray") -> torch.Tensor:
    """``part``'s bytes as a flat uint8 tensor sharing its memory (read-only bytes are sent,
    never written)."""
    a = np.frombuffer(part, dtype=np.uint8) if not isinstance(part, np.ndarray) else part.view(np.uint8).reshape(-1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)
