"""flexckpt in a Hugging Face Accelerate loop (AcceleratorCheckpoint; see helpers/accelerate_runs.py):
2 processes with torchrun's environment, Accelerator(cpu=True) on gloo, a tiny MLP made here.

- stopped after step 9 (one batch into epoch 2) and resumed: the uninterrupted run's losses,
  exactly; no .bin or .pkl written;
- the 2-process step 9 resumed by 1 process with the same global batch: the same samples per
  step, so the losses agree to float rounding (the RNG states, per process, stay as seeded).
"""
from __future__ import annotations

import os
import socket

import pytest

pytest.importorskip("accelerate", reason="Accelerate is not installed (pip install -e .[accelerate])")

import accelerate_runs as ar  # noqa: E402
from flexshard.spawn import run_workers  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_stopped_and_resumed_give_the_uninterrupted_losses(tmp_path):
    per_rank = run_workers(ar.runs, 2, str(tmp_path), free_port(), backend="none", timeout=240)
    for rank, runs in enumerate(per_rank):
        full = runs["full"]
        assert sorted(full) == list(range(1, 17)), rank  # 2 epochs of 8 global batches of 4
        assert runs["stopped"] == {s: full[s] for s in range(1, 10)}, rank
        assert runs["resumed"] == {s: full[s] for s in range(10, 17)}, rank
    written = [f for _, _, files in os.walk(tmp_path) for f in files]
    assert not [f for f in written if f.endswith((".bin", ".pkl", ".pt", ".pth", ".safetensors"))]
    assert sorted(os.listdir(tmp_path / "cut")) == ["step-000000000012", "step-000000000015"]  # keep_last=2

    alone = run_workers(ar.resume_alone, 1, str(tmp_path), free_port(), backend="none", timeout=240)[0]
    assert sorted(alone) == list(range(10, 17))
    assert alone == pytest.approx({s: per_rank[0]["full"][s] for s in alone}, rel=1e-5)
