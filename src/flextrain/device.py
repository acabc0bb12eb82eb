"""Where a run computes: the one place the device, the process-group backend, the
autocast dtype and the host-to-device batch copies are chosen.

``device`` is a performance setting (``auto``: CUDA when present); ``autocast`` changes the
numbers (``auto``: bf16 on CUDA, none on the CPU) and enters the fingerprint once resolved,
so a run resumes bit-exactly on the same device kind, and a run with other numbers is
refused by name (``autocast: saved 'bf16', now 'none'``).
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
from typing import Any, Callable

import torch

from flextrain.config import AUTOCASTS, DEVICES, TrainConfig


def choose_device(setting: str, local_rank: int | None = None, cuda_available: Callable[[], bool] | None = None) -> torch.device:
    """``cuda:<LOCAL_RANK>`` or ``cpu``. ``cuda`` without a GPU is an error naming the fix."""
    has_cuda = (cuda_available or torch.cuda.is_available)()
    if setting not in DEVICES:
        raise ValueError(f"device={setting!r} must be one of {DEVICES}")
    if setting == "cuda" and not has_cuda:
        raise ValueError("device='cuda' but torch sees no CUDA device; use --set device=cpu (or auto)")
    if setting == "cpu" or not has_cuda:
        return torch.device("cpu")
    index = int(os.environ.get("LOCAL_RANK", "0")) if local_rank is None else local_rank
    return torch.device("cuda", index)


def resolve_autocast(setting: str, device: torch.device) -> str:
    """``bf16`` or ``none``: what the forward runs in (``auto``: bf16 on CUDA)."""
    if setting not in AUTOCASTS:
        raise ValueError(f"autocast={setting!r} must be one of {AUTOCASTS}")
    if setting == "auto":
        return "bf16" if device.type == "cuda" else "none"
    return setting


def resolve(cfg: TrainConfig, device: torch.device) -> TrainConfig:
    """A new configuration, ``cfg`` with what depends on the device resolved (``autocast``:
    ``auto`` becomes what ``device`` runs): the one a run uses, fingerprints and saves. It
    shares nothing with ``cfg``, which is not changed; a valid ``cfg`` gives a valid one."""
    return dataclasses.replace(copy.deepcopy(cfg), autocast=resolve_autocast(cfg.autocast, device))


def backend_for(device: torch.device) -> str:
    """NCCL for GPUs, gloo for the CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def prepare(device: torch.device) -> None:
    """Bind this process to its GPU and make its kernels deterministic (a resumed run then
    computes the very bits an uninterrupted one does); nothing on the CPU."""
    if device.type != "cuda":
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts
    torch.cuda.set_device(device)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def autocast(setting: str, device: torch.device) -> Any:
    """The forward's context: bf16 autocast, or nothing."""
    if setting == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def to_device(tensors: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """A batch's tensors on ``device``: through pinned host memory (the caching host
    allocator hands the same pinned blocks back step after step) with ``non_blocking``
    copies, so the copy overlaps the work already queued on the GPU."""
    if device.type == "cpu":
        return tensors
    return {k: v.pin_memory().to(device, non_blocking=True) for k, v in tensors.items()}
