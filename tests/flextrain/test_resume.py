"""flextrain end to end: torchrun at D=2 trains `tiny` (shrunk: d=64, T=64, global batch 8,
8 steps, GPT-2 vocabulary) and checkpoints; a resume at D=1 and D=4 sees the same global batches;
the plan predicts bytes read and batch digests; a flipped byte falls back; a changed data
field is refused; SIGTERM takes a final checkpoint.

D=1 runs (a resume, the noise floor) run in this process, as torchrun with one rank would
run them (no process group). A resume at D=4 is a torchrun of four ranks. SIGTERM to a
torchrun of two ranks (another launch of a property covered) runs with ``python3 dev.py
test-flextrain`` (``FLEXTRAIN_MATRIX=1``), which runs the node-loss test too."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from flexckpt import Checkpointer
from flextrain.cli import main as flextrain_main
from flextrain.launch import copy_run_at as cut_at, metrics

SHRINK = ["--set", "data.max_length=64", "--set", "data.global_batch=8", "--set", "data.micro_batch=2",
          "--set", "model.d_model=64", "--set", "model.d_ff=128", "--set", "eval_every=4", "--set", "ckpt_every=4",
          "--set", "optim.warmup_steps=2"]
STEPS = 8
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[2] / "src"))
# more ranks and launches of the same properties: python3 dev.py test-flextrain
MATRIX = pytest.mark.skipif(os.environ.get("FLEXTRAIN_MATRIX") != "1",
                            reason="another launch of a property the suite covers: run with python3 dev.py test-flextrain")


def torchrun(nproc: int, run_dir: Path, *extra: str, timeout: float = 180) -> subprocess.CompletedProcess:
    cmd = [TORCHRUN, "--standalone", f"--nproc-per-node={nproc}", "-m", "flextrain", "train",
           "--run-dir", str(run_dir), *SHRINK, *extra]
    return subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=timeout)


def masters(run_dir: Path, step: int, preset: str = "tiny") -> dict[str, torch.Tensor]:
    ckpt = Checkpointer(str(run_dir / "ckpt"), rank=0, world_size=1, run_id="test")
    with torch.device("meta"):
        from flextrain.config import load_config
        from flextrain.model import Transformer
        model = load_config(preset, sets=["model.d_model=64", "model.d_ff=128"]).model  # SHRINK's model
        shapes = {n: tuple(p.shape) for n, p in Transformer(model).named_parameters()}
    state = {"model": {n: torch.empty(s) for n, s in shapes.items()}}
    assert ckpt.load(state, step=step, strict=False) == step
    ckpt.close()
    return state["model"]


def train(world: int, run_dir: Path, *extra: str) -> None:
    """At D=1 in this process (as torchrun with one rank would run it: no process group),
    else under torchrun."""
    if world == 1:
        assert flextrain_main(["train", "--run-dir", str(run_dir), *SHRINK, *extra]) == 0
    else:
        out = torchrun(world, run_dir, *extra)
        assert out.returncode == 0, out.stderr[-3000:]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("ref") / "run"
    out = torchrun(2, run, "--set", f"steps={STEPS}")
    assert out.returncode == 0, out.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def noise_floor(tmp_path_factory, reference) -> Path:
    """The reference again at D=1 (in this process), the whole global batch in one micro
    batch: same data, another accumulation order, so its distance from the reference is what
    reduction order alone does."""
    run = tmp_path_factory.mktemp("floor") / "run"
    train(1, run, "--set", f"steps={STEPS}", "--set", "data.micro_batch=8")
    return run


def test_torchrun_at_two_ranks_trains_and_checkpoints(reference):
    rows = metrics(reference)
    assert sorted(rows) == list(range(1, STEPS + 1))
    assert Checkpointer(str(reference / "ckpt"), rank=0, world_size=1, run_id="t").steps() == [4, 8]
    assert all(len(r["global_batch_sha256"]) == 64 and r["world"] == 2 for r in rows.values())
    assert rows[STEPS]["loss"] < rows[1]["loss"] - 0.1  # it learns
    assert "eval_loss" in rows[4] and "eval_loss" in rows[8]


@pytest.mark.parametrize("world", [1, 4])
def test_resume_at_another_world_size_sees_the_same_batches(reference, noise_floor, tmp_path, capsys, world):
    run = cut_at(reference, tmp_path / "run", 4)
    capsys.readouterr()
    assert flextrain_main(["plan", str(run), "--world", str(world), "--batches", "4", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    train(world, run, "--set", f"steps={STEPS}")
    ref, got = metrics(reference), metrics(run)
    for step in range(5, STEPS + 1):
        assert got[step]["world"] == world
        assert got[step]["global_batch_sha256"] == ref[step]["global_batch_sha256"]
        # float32 sums over tokens, microbatches and ranks run in another order at another D
        assert abs(got[step]["loss"] - ref[step]["loss"]) < 1e-3
    assert [b["global_batch_sha256"] for b in plan["next_batches"]] == \
        [ref[s]["global_batch_sha256"] for s in range(5, 9)]
    for r in plan["ranks"]:  # the plan's bytes are what each rank's load read
        logged = json.loads((run / f"resume-w{world}-r{r['rank']}.json").read_text())
        assert logged["bytes_read"] == r["reads"]
    # Parameters: float32 sums over tokens, microbatches and ranks run in another order at
    # another D, and Muon's bf16 Newton-Schulz and Adam's m/sqrt(v) amplify last-bit
    # differences. The tolerance is measured, not guessed: per tensor, the largest
    # difference may not exceed what the same run at D=1 in one micro batch (8 steps of
    # reduction-order drift) shows, and the mean difference stays far below the 4 steps' update.
    ref, res, floor, start = masters(reference, STEPS), masters(run, STEPS), masters(noise_floor, STEPS), masters(reference, 4)
    for name in ref:
        diff = (res[name] - ref[name]).abs()
        assert diff.max() <= (floor[name] - ref[name]).abs().max(), name
        assert diff.mean() < 0.05 * (ref[name] - start[name]).abs().mean(), name


def test_flexckpt_reshard_then_resume_equals_a_direct_resume(reference, tmp_path):
    direct = cut_at(reference, tmp_path / "direct", 4)
    resharded = tmp_path / "resharded"
    shutil.copytree(direct, resharded, ignore=shutil.ignore_patterns("ckpt"))
    from flexckpt.cli import main as flexckpt_main
    assert flexckpt_main(["reshard", str(direct / "ckpt"), str(resharded / "ckpt"), "--world", "1"]) == 0
    for run in (direct, resharded):
        assert flextrain_main(["train", "--run-dir", str(run), *SHRINK, "--set", "steps=5"]) == 0
    assert metrics(direct)[5]["global_batch_sha256"] == metrics(resharded)[5]["global_batch_sha256"]
    a, b = masters(direct, 5), masters(resharded, 5)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_the_blocks_preset_trains_and_a_resume_repeats_the_uninterrupted_run(tmp_path):
    """Issue 30's preset (its 4,096-token BPE, vocabulary and 8 layers; SHRINK's width, so a
    step takes well under a second) at D=1: 2 steps straight, and a resume from the step-1
    checkpoint to step 2, give the same batch, the same loss and the same weights."""
    run = tmp_path / "run"
    blocks = ("--preset", "blocks", "--set", "ckpt_every=1", "--set", "eval_every=2", "--set", "steps=2")
    train(1, run, *blocks)
    resumed = cut_at(run, tmp_path / "resumed", 1)
    train(1, resumed, *blocks)
    ref, got = metrics(run), metrics(resumed)
    assert got[2]["global_batch_sha256"] == ref[2]["global_batch_sha256"]
    assert (got[2]["loss"], got[2]["eval_loss"]) == (ref[2]["loss"], ref[2]["eval_loss"])
    a, b = masters(run, 2, "blocks"), masters(resumed, 2, "blocks")
    assert a["embed.weight"].shape == (4096, 64) and len(a) == len(b) == 2 + 8 * 7 + 1
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_a_changed_data_field_is_refused_naming_it(reference, tmp_path, capsys):
    run = cut_at(reference, tmp_path / "run", 4)
    assert flextrain_main(["train", "--run-dir", str(run), *SHRINK, "--set", "data.shuffle_buffer=32",
                           "--set", "steps=6"]) == 2
    err = capsys.readouterr().err
    assert "data.shuffle_buffer: saved 64, now 32" in err
    assert sorted(metrics(run)) == [1, 2, 3, 4]  # nothing trained


def test_plan_refuses_a_size_that_does_not_divide_the_lanes(reference, capsys):
    from flextrain.cli import main

    assert main(["plan", str(reference), "--world", "3"]) == 2
    out = capsys.readouterr().out
    assert "data.lanes=8 is not a multiple of 3" in out and "[1, 2, 4, 8]" in out


def test_a_flipped_byte_in_the_newest_checkpoint_falls_back(reference, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    data = sorted((run / "ckpt" / "step-000000000008").rglob("*.data"))[0]
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    assert flextrain_main(["train", "--run-dir", str(run), *SHRINK, "--set", "steps=5"]) == 0
    assert "the newest checkpoint (step 8) could not be read; resumed from step 4" in capsys.readouterr().err
    assert metrics(run)[5]["global_batch_sha256"] == metrics(reference)[5]["global_batch_sha256"]


def _wait_for_steps(run: Path, n: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (run / "metrics.jsonl").exists() and len((run / "metrics.jsonl").read_text().splitlines()) >= n:
            return
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.1)
    proc.kill()
    raise TimeoutError(f"no {n} steps within {timeout} s")


# A signal to one worker of two: the stop reaches the other rank (its stop flag is reduced
# with the step's label count) and both save the same final step. A signal to torchrun:
# torchrun forwards it to its workers, one in the suite, two in the matrix.
@pytest.mark.parametrize("target,nproc", [("one worker", 2), ("torchrun", 1), pytest.param("torchrun", 2, marks=MATRIX)])
def test_sigterm_takes_a_final_checkpoint_and_exits(tmp_path, target, nproc):
    run = tmp_path / "run"
    cmd = [TORCHRUN, "--standalone", f"--nproc-per-node={nproc}", "-m", "flextrain", "train", "--run-dir", str(run),
           *SHRINK, "--set", "steps=200", "--set", "ckpt_every=100", "--set", "eval_every=100"]
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_steps(run, 2, proc)
        if target == "torchrun":
            proc.send_signal(signal.SIGTERM)
        else:
            worker = int((run / "rank1.pid").read_text())
            os.kill(worker, signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    # torchrun itself answers its own SIGTERM with exit 1 (it raises SignalException after
    # its workers have exited); the workers exit 0, which a signal to one of them shows
    assert proc.returncode == (0 if target == "one worker" else 1), err[-3000:]
    last = max(metrics(run))
    assert 2 <= last < 200
    assert Checkpointer(str(run / "ckpt"), rank=0, world_size=1, run_id="t").steps() == [last]
    assert err.count("stopping at step") == 1 and f"stopping at step {last}" in err
