"""What the trainer integrations need from flexckpt itself: pinned steps that retention keeps
(a trainer's best step), RNG states as per-rank values (never pickled), and the state check
without a Checkpointer."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from flexckpt import Checkpointer, UnsupportedState
from flexckpt.rng import load_rng_state, rng_state
from flexckpt.state.structure import check_state


def draws() -> tuple:
    return random.random(), float(np.random.rand()), torch.rand(2).tolist()


def test_retention_keeps_a_pinned_step_besides_keep_last(tmp_path):
    ckpt = Checkpointer(str(tmp_path), rank=0, world_size=1, keep_last=2)
    for step in (1, 2, 3, 4, 5):
        if step == 3:
            ckpt.pinned = frozenset({2})
        ckpt.save(step, {"w": torch.full((2,), float(step))}).result()
        ckpt.wait()
    assert ckpt.steps() == [2, 4, 5]
    ckpt.pinned = frozenset()
    ckpt.save(6, {"w": torch.zeros(2)}).result()
    ckpt.wait()
    assert ckpt.steps() == [5, 6]
    ckpt.close()


def test_rng_states_round_trip_at_the_saving_world_size_only(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    ckpt = Checkpointer(str(tmp_path), rank=0, world_size=1)
    ckpt.save(7, {"w": torch.ones(1), "rng": rng_state()}).result()
    expected = draws()
    draws()  # move every generator on
    assert load_rng_state(ckpt, 7) is True
    assert draws() == expected
    ckpt.close()
    # another world size: nothing restored, nothing changed (per-rank values)
    other = Checkpointer(str(tmp_path), rank=0, world_size=2, run_id="r", read_only=True)
    before = (random.getstate(), torch.get_rng_state())
    assert load_rng_state(other, 7) is False
    assert (random.getstate(), torch.get_rng_state().tolist()) == (before[0], before[1].tolist())
    assert not any(f.endswith((".pkl", ".pt", ".pth")) for f in map(str, tmp_path.rglob("*")))


def test_check_state_names_the_key_at_the_given_world():
    class Opaque:
        pass

    with pytest.raises(UnsupportedState, match="hyper_parameters/thing"):
        check_state({"hyper_parameters": {"thing": Opaque()}, "w": torch.ones(1)})
    check_state({"w": torch.ones(1), "lr": 0.1}, rank=1, world_size=2)
