"""A process's random number generators as :class:`~flexckpt.state.values.PerRank` values.

Python's ``random``, NumPy's global generator, torch's CPU generator and, where CUDA is
present, every CUDA device's: what trainers save per process (Accelerate's
``random_states_<i>.pkl``, the transformers Trainer's ``rng_state_<i>.pth``), here as JSON
and uint8 tensors, never pickled. Being per rank, they are restored only at the world size
that saved them (see ``PerRank``); a resume at another size leaves them as seeded.
"""
from __future__ import annotations

import random
from typing import TYPE_CHECKING

import numpy as np
import torch

from flexckpt.state.values import PerRank

if TYPE_CHECKING:
    from flexckpt.checkpointer import Checkpointer


def rng_state() -> dict[str, PerRank]:
    """This process's generators, one ``PerRank`` each (put it in the saved state)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss = random.getstate()
    state = {
        "python": PerRank([version, list(internal), gauss]),
        "numpy": PerRank([kind, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)]),
        "torch": PerRank(torch.get_rng_state()),
    }
    if torch.cuda.is_available():
        state["cuda"] = PerRank(torch.stack(torch.cuda.get_rng_state_all()))
    return state


def set_rng_state(state: dict[str, PerRank]) -> None:
    """Set this process's generators from what :func:`rng_state` gave (after a load)."""
    version, internal, gauss = state["python"].value
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"].value
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"].value)
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(state["cuda"].value))


def load_rng_state(ckpt: "Checkpointer", step: int, key: str = "rng") -> bool:
    """Set this process's generators from what ``step`` holds under ``key`` (saved from
    :func:`rng_state`); the rest of the step is not read. False, changing nothing, when the
    step has none or was saved at another world size (every rank calls it: a load)."""
    template = {key: rng_state()}
    ckpt.load(template, step, strict=False)
    if not all(v.restored for v in template[key].values()):
        return False
    set_rng_state(template[key])
    return True
