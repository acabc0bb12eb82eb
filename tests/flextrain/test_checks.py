"""flextrain refuses what it cannot run before step 1, in one line and exit 2: every
configuration field against its range or choices, the files and tokenizer it reads, and the
held-out pipeline's batch geometry; a non-finite loss or weights stop every rank before that
step's checkpoint (exit 2); a signal during start-up stops cleanly (exit 0)."""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from flexckpt import Checkpointer
from flextrain.cli import main
from flextrain.config import RULES, ConfigError, TrainConfig, eval_micro_batch, load_config
from flextrain.launch import metrics

SHRINK = ["--set", "data.max_length=64", "--set", "model.d_model=64", "--set", "model.d_ff=128",
          "--set", "optim.warmup_steps=2"]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[2] / "src"))


def _leaf_fields(obj, prefix: str = ""):
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from _leaf_fields(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}"


def test_every_config_field_has_a_range_or_choices():
    fields = list(_leaf_fields(TrainConfig()))
    missing = [f for f in fields if f not in RULES]
    assert not missing, f"fields without a rule in flextrain.config.RULES (add their range or choices): {missing}"
    assert sorted(RULES) == sorted(fields)
    for path in fields:  # a value of the wrong type is refused naming the field, whatever the field
        *heads, name = path.split(".")
        cfg = TrainConfig()
        obj = cfg
        for h in heads:
            obj = getattr(obj, h)
        setattr(obj, name, None)
        with pytest.raises(ConfigError, match=rf"^{path.replace('.', '[.]')}=None is not allowed: it must be "):
            cfg.validate()


# (--set value, the field and value the message names, what it says is allowed)
BAD_VALUES = [
    ("optim.adamw_lr=NaN", "optim.adamw_lr=nan", "a number in [0, 100]"),
    ("optim.adamw_lr=Infinity", "optim.adamw_lr=inf", "a number in [0, 100]"),
    ("optim.muon_lr=-0.01", "optim.muon_lr=-0.01", "a number in [0, 100]"),
    ("optim.muon_lr=NaN", "optim.muon_lr=nan", "a number in [0, 100]"),
    ("optim.weight_decay=-0.1", "optim.weight_decay=-0.1", "a number in [0, 100]"),
    ("optim.warmup_steps=-3", "optim.warmup_steps=-3", "an int >= 0"),
    ("optim.min_lr_ratio=5", "optim.min_lr_ratio=5.0", "a number in [0, 1]"),
    ("optim.decay=step", "optim.decay='step'", "one of 'cosine', 'linear'"),
    ("model.rope_base=0", "model.rope_base=0.0", "a finite number > 1"),
    ("model.init_std=-1", "model.init_std=-1.0", "a number in (0, 10]"),
    ("seed=-1", "seed=-1", "an int from 0 to 9223372036854775807"),
    ("seed=1.5", "seed=1.5", "an int from 0 to 9223372036854775807"),
    ("seed=100000000000000000000000", "seed=100000000000000000000000", "an int from 0 to 9223372036854775807"),
    ("seed=true", "seed=True", "an int from 0"),
    ("steps=0", "steps=0", "an int >= 1"),
    ("steps=abc", "steps='abc'", "an int >= 1"),  # not JSON: named like any other bad value
    ("optim.muon_lr=fast", "optim.muon_lr='fast'", "a number in [0, 100]"),
    ("data.packing=bogus", "data.packing='bogus'", "one of 'wrap', 'best_fit'"),
    ("data.tokenizer=./no-such-tokenizer.json", "data.tokenizer='./no-such-tokenizer.json'",
     "pass tokenizer_id='gpt2' or the path of a tokenizer.json"),
    ('data.shares={"prose": 0, "code": 1}', "data.shares['prose']=0", "a finite number > 0"),
    ('data.shares={"prose": 0.7, "code": -0.3}', "data.shares['code']=-0.3", "a finite number > 0"),
    ('data.sources={"prose": "/no/such/kjv.jsonl.zst", "code": "/no/such/py.jsonl.zst"}',
     "data.sources['prose']='/no/such/kjv.jsonl.zst'", "no such file; give an existing file"),
    ("data.heldout_fraction=0.999999", "data.heldout_fraction=0.999999", "a number in (0, 0.5]"),
    ("data.heldout_fraction=0", "data.heldout_fraction=0.0", "a number in (0, 0.5]"),
    ("data.loader=fast", "data.loader='fast'", "one of 'zephon', 'usual'"),
    ("data.workers=100000", "data.workers=100000", "an int from 1 to 256"),
]


@pytest.mark.parametrize("assignment,named,allowed", BAD_VALUES, ids=[b[0][:40] for b in BAD_VALUES])
def test_a_bad_value_is_one_line_naming_field_value_and_range(tmp_path, capsys, assignment, named, allowed):
    assert main(["train", "--run-dir", str(tmp_path / "run"), "--set", assignment]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"flextrain: {named} is not allowed: ") and err.count("\n") == 1, err
    assert allowed in err, err
    assert not (tmp_path / "run" / "ckpt").exists()  # refused before anything was built


def test_evaluation_micro_batch_divides_the_held_out_rows():
    assert eval_micro_batch(2, lanes=6, world=2) == 1  # 3 rows per rank: the layout of the issue
    assert eval_micro_batch(2, lanes=8, world=2) == 2  # 4 rows: as before
    assert eval_micro_batch(4, lanes=12, world=2) == 3  # 6 rows: the largest divisor up to 4
    assert eval_micro_batch(8, lanes=8, world=4) == 2  # fewer rows than the micro batch: all of them
    assert eval_micro_batch(5, lanes=7, world=1) == 1  # 7 rows, prime


def test_held_out_pipeline_of_six_lanes_on_two_ranks_yields_its_rows():
    from flextrain.data import heldout_pipeline

    cfg = load_config(sets=["data.lanes=6", "data.global_batch=12", "data.micro_batch=2", "data.max_length=64"])
    cfg.check_world(2)  # training: 6 rows per rank, micro batch 2
    for rank in (0, 1):
        with heldout_pipeline(cfg.data, cfg.seed, rank, 2, calibration={"prose": 0.3, "code": 0.3}) as p:
            p.fingerprint()  # what start-up checks
            rows = []
            while not rows or not b.last_in_step:
                b = next(p)
                rows.append(b.input_ids.shape[0])
            assert rows == [1, 1, 1]  # 3 rows of the 6 lanes, one per forward pass


def test_a_held_out_geometry_that_cannot_run_is_refused_before_step_1(tmp_path, capsys, monkeypatch):
    """Start-up builds and checks the held-out pipeline too: with the old evaluation micro
    batch (min(micro batch, rows): 2 for 3 rows) the run stops before its first step."""
    import flextrain.data

    monkeypatch.setattr(flextrain.data, "eval_micro_batch", lambda micro, lanes, world: min(micro, lanes // world))
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *SHRINK, "--set", "data.lanes=3", "--set", "data.global_batch=6",
                 "--set", "data.micro_batch=2", "--set", "steps=2"]) == 2
    err = capsys.readouterr().err
    assert err == ("flextrain: data: the local batch global_batch_size/size = 3/1 = 3 rows is not divisible by "
                   "microbatch_size=2; use a microbatch size that divides 3 (e.g. 1)\n")
    assert not (run / "metrics.jsonl").exists()


def _count_training_calls(monkeypatch, nan_from_call: int | None = None) -> None:
    """Make the training loss (not evaluation's) NaN from its ``nan_from_call``-th call."""
    import flextrain.trainer as trainer

    real, calls = trainer.token_loss_sum, [0]

    def loss_sum(model, batch):
        loss, n = real(model, batch)
        if torch.is_grad_enabled():
            calls[0] += 1
            if nan_from_call is not None and calls[0] >= nan_from_call:
                loss = loss * float("nan")
        return loss, n

    monkeypatch.setattr(trainer, "token_loss_sum", loss_sum)


def test_odd_held_out_rows_evaluate_and_a_nan_loss_stops_before_its_checkpoint(tmp_path, capsys, monkeypatch):
    """1 rank, 3 lanes, global batch 6, micro batch 2: the held-out batch has 3 rows, which
    micro batch 2 does not divide (the issue's crash at the first evaluation); step 2
    evaluates and is checkpointed. Step 3's loss is NaN (3 microbatches a step: from the 7th
    call): the run stops at step 3 with exit 2 and logs and checkpoints nothing of it."""
    _count_training_calls(monkeypatch, nan_from_call=7)
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *SHRINK, "--set", "data.lanes=3", "--set", "data.global_batch=6",
                 "--set", "data.micro_batch=2", "--set", "data.eval_batches=1", "--set", "steps=4",
                 "--set", "ckpt_every=2", "--set", "eval_every=2"]) == 2
    err = capsys.readouterr().err
    assert err.endswith("flextrain: step 3: the loss is nan; stopped on every rank before this step's checkpoint "
                        "(the last one taken is step 2); lower optim.muon_lr / optim.adamw_lr or check the data\n")
    rows = metrics(run)
    assert sorted(rows) == [1, 2] and 0 < rows[2]["eval_loss"] < 20
    assert Checkpointer(str(run / "ckpt"), rank=0, world_size=1, run_id="t").steps() == [2]


def test_non_finite_weights_stop_before_their_checkpoint(tmp_path, capsys, monkeypatch):
    """A step's loss is computed before its update: weights the update made infinite are
    caught on the save step itself."""
    from flexshard import ShardedOptimizer

    real_step = ShardedOptimizer.step

    def step(self):
        real_step(self)
        self.entries[0].master.local.fill_(float("inf"))

    monkeypatch.setattr(ShardedOptimizer, "step", step)
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *SHRINK, "--set", "data.lanes=3", "--set", "data.global_batch=3", "--set", "data.micro_batch=3",
                 "--set", "steps=2", "--set", "ckpt_every=1"]) == 2
    err = capsys.readouterr().err
    assert "flextrain: step 1: the loss is " in err
    assert err.endswith(" and the updated weights are not finite; stopped on every rank before this step's "
                        "checkpoint (no checkpoint was taken); lower optim.muon_lr / optim.adamw_lr or check the "
                        "data\n")
    assert not (run / "metrics.jsonl").exists()
    assert Checkpointer(str(run / "ckpt"), rank=0, world_size=1, run_id="t").steps() == []


def test_sigterm_during_start_up_stops_cleanly(tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "flextrain", "train", "--run-dir", str(run), *SHRINK, "--set", "steps=1000"]
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (run / "rank0.pid").exists():  # written by the trainer's start-up, before the data is built
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate(timeout=10)[1][-3000:]
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    assert err == ("flextrain: SIGTERM received: during start-up: stopping before the first step\n"
                   "flextrain: stopped by a signal during start-up, before any step; nothing to save\n")
    assert not (run / "metrics.jsonl").exists()


def test_a_signal_before_the_checkpoint_load_skips_it_and_keeps_the_fast_tier(tmp_path, capsys, monkeypatch):
    """A restart stopped during start-up (here: SIGTERM while the model builds) stops before
    the checkpoint load, saves nothing, exits 0 as a stop in training does, and keeps the
    node's fast-tier folder, whose newest step a restart may need."""
    import flexckpt
    import flextrain.trainer

    run, tier = tmp_path / "run", tmp_path / "tier"
    args = ["train", "--run-dir", str(run), *SHRINK, "--set", "data.lanes=1", "--set", "data.global_batch=1",
            "--set", "data.micro_batch=1", "--set", "data.eval_batches=1", "--set", "ckpt_every=1",
            "--set", "ckpt_local_every=1", "--set", f"ckpt_local_dir={tier}"]
    assert main([*args, "--set", "steps=1"]) == 0
    capsys.readouterr()
    loads, load = [], flexckpt.Checkpointer.load

    def noted_load(self, state, *a, **k):
        if "model" in state:  # not the probe of plain values that decides whether to resume
            loads.append(sorted(state))
        return load(self, state, *a, **k)

    monkeypatch.setattr(flexckpt.Checkpointer, "load", noted_load)
    build = flextrain.trainer.build_optimizer

    def signalled_build(*a):
        os.kill(os.getpid(), signal.SIGTERM)
        return build(*a)

    monkeypatch.setattr(flextrain.trainer, "build_optimizer", signalled_build)
    assert main([*args, "--set", "steps=2"]) == 0
    assert capsys.readouterr().err == ("flextrain: SIGTERM received: during start-up: stopping before the first step\n"
                                       "flextrain: stopped by a signal during start-up, before any step; nothing to "
                                       "save\n")
    assert loads == [] and not (run / "resume-w1-r0.json").exists()
    assert sorted(metrics(run)) == [1]
    assert Checkpointer(str(run / "ckpt"), rank=0, world_size=1, run_id="t").steps() == [1]
    assert len(os.listdir(tier)) == 1  # the run's node folder, which a clean exit would have removed


def _diverge_at_step_4(monkeypatch) -> None:
    """Training raises TrainingDiverged at step 4, each step after the previous fast save
    is done (none skipped)."""
    from flextrain.trainer import Trainer, TrainingDiverged

    gather = Trainer._gather_step

    def diverging(self, *a):
        self.ckpt.tier.wait()
        if self.step == 4:
            raise TrainingDiverged("step 4: the loss is nan (test)")
        return gather(self, *a)

    monkeypatch.setattr(Trainer, "_gather_step", diverging)


def test_an_error_in_training_keeps_the_fast_tier_whose_newest_step_a_restart_resumes(tmp_path, capsys, monkeypatch):
    """A run that fails during training (here: TrainingDiverged at step 4, after the
    persistent save of step 2 and the fast save of step 3) keeps the node's fast-tier
    folder, whose step 3 is newer than the store's newest: the restart resumes from it. A
    clean finish (its last step committed to the store) removes the folder."""
    from flexckpt.storage import Storage
    from flexckpt.tier.inventory import scan

    run, tier = tmp_path / "run", tmp_path / "tier"
    args = ["train", "--run-dir", str(run), *SHRINK, "--set", "data.lanes=1", "--set", "data.global_batch=1",
            "--set", "data.micro_batch=1", "--set", "data.eval_batches=1", "--set", "ckpt_every=2",
            "--set", "ckpt_local_every=1", "--set", f"ckpt_local_dir={tier}", "--set", "steps=4"]
    _diverge_at_step_4(monkeypatch)
    assert main(args) == 2
    assert capsys.readouterr().err.endswith("flextrain: step 4: the loss is nan (test)\n")
    assert Checkpointer(str(run / "ckpt"), rank=0, world_size=1, run_id="t", read_only=True).steps() == [2]
    (folder,) = tier.iterdir()  # kept: a clean exit would have removed it
    assert max(h.step for h in scan(Storage(str(folder)))) == 3
    monkeypatch.undo()
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "flextrain: resuming from the fast tier's step 3 (the persistent store's newest: 2)\n" in err, err
    assert sorted(metrics(run)) == [1, 2, 3, 4]
    assert Checkpointer(str(run / "ckpt"), rank=0, world_size=1, run_id="t", read_only=True).steps()[-1] == 4
    assert list(tier.iterdir()) == []  # a clean finish, step 4 in the store: the folder goes


def test_a_crash_before_the_first_persistent_save_resumes_from_the_fast_tier(tmp_path, capsys, monkeypatch):
    """Fast saves every step, persistent every 10: a run that fails at step 4 leaves nothing
    in the store and steps 2 and 3 in the node's fast tier. The restart resumes from the
    tier's step 3 and trains steps 4 and 5 on the batches, with the losses, of a run never
    interrupted; ``--fresh`` is refused there (the tier's step would outrank the new run's).
    Where the tier cannot restore any step (every step lacks a saved rank: its node lost),
    the restart says so and starts from step 0, as a new run."""
    import shutil

    from flexckpt.storage import Storage
    from flexckpt.tier.inventory import scan

    run, tier = tmp_path / "run", tmp_path / "tier"
    shape = [*SHRINK, "--set", "data.lanes=1", "--set", "data.global_batch=1", "--set", "data.micro_batch=1",
             "--set", "data.eval_batches=1", "--set", "ckpt_every=10", "--set", "steps=5"]
    args = ["train", "--run-dir", str(run), *shape, "--set", "ckpt_local_every=1", "--set", f"ckpt_local_dir={tier}"]
    assert main(["train", "--run-dir", str(tmp_path / "ref"), *shape]) == 0
    ref = metrics(tmp_path / "ref")
    _diverge_at_step_4(monkeypatch)
    assert main(args) == 2
    monkeypatch.undo()
    capsys.readouterr()
    assert Checkpointer(str(run / "ckpt"), rank=0, world_size=1, run_id="t", read_only=True).steps() == []
    (folder,) = tier.iterdir()
    assert sorted({h.step for h in scan(Storage(str(folder)))}) == [2, 3]
    shutil.copytree(tmp_path, tmp_path.parent / f"{tmp_path.name}-crashed")  # for the node loss below

    assert main([*args, "--fresh"]) == 2
    assert f"--fresh: the fast tier ({folder}) holds step 3 of an earlier run in {run}" in capsys.readouterr().err
    # a changed model (another structure) is refused, as a store resume refuses it, and the tier keeps its steps
    assert main([*args, "--set", "model.d_ff=64"]) == 2
    err = capsys.readouterr().err
    assert "flextrain: the fast tier's step 3 cannot be restored (" in err and \
        "it was saved with another model structure than this config's; restore the run's config" in err, err
    assert sorted({h.step for h in scan(Storage(str(folder)))}) == [2, 3]

    assert main(args) == 0
    err = capsys.readouterr().err
    assert "flextrain: resuming from the fast tier's step 3 (the persistent store has none)\n" in err, err
    assert json.loads((run / "resume-w1-r0.json").read_text())["step"] == 3
    got = metrics(run)
    assert sorted(got) == [1, 2, 3, 4, 5]
    for step in range(1, 6):  # one process, the same order of sums: equal to the bit
        assert (got[step]["global_batch_sha256"], got[step]["loss"]) == \
            (ref[step]["global_batch_sha256"], ref[step]["loss"]), step
    assert Checkpointer(str(run / "ckpt"), rank=0, world_size=1, run_id="t", read_only=True).steps() == [5]
    assert list(tier.iterdir()) == []  # a clean finish: the folder goes

    # the node of saved rank 1 lost (as a world of 2 saved it): no step is complete on the nodes left
    shutil.rmtree(run)
    shutil.rmtree(tier)
    for name in ("run", "tier"):
        shutil.copytree(tmp_path.parent / f"{tmp_path.name}-crashed" / name, tmp_path / name)
    for marker in folder.rglob("r00000-w00001.done"):
        marker.rename(marker.with_name("r00000-w00002.done"))
    assert main([*args, "--set", "steps=1"]) == 0  # one step shows a new run
    err = capsys.readouterr().err
    assert ("flextrain: the fast tier's step 3 cannot be restored (no fast-tier step is complete and nothing is "
            "persistent; tier step 3 lacks the files of saved rank(s) [1] on every surviving node), and the "
            "persistent store has no checkpoint: starting from step 0\n") in err, err
    got = metrics(run)  # the crashed run's rows 1-3, then the new run's step 1 (a later row wins)
    assert (got[1]["global_batch_sha256"], got[1]["loss"]) == (ref[1]["global_batch_sha256"], ref[1]["loss"])
    assert Checkpointer(str(run / "ckpt"), rank=0, world_size=1, run_id="t", read_only=True).steps() == [1]
    assert not (run / "resume-w1-r0.json").exists()


def test_a_removed_run_folder_never_comes_back_from_the_fast_tier(tmp_path, capsys, monkeypatch):
    """A run killed before its first persistent save leaves steps 2 and 3 in the fast tier;
    ``--fresh`` is refused there, advising to remove the run folder. Removed, the same
    command (``--fresh`` or not) starts a new run from step 1: the tier belongs to the run
    folder's identity (its ``fast-tier.json``), which the removal took with it."""
    import shutil

    run, tier = tmp_path / "run", tmp_path / "tier"
    args = ["train", "--run-dir", str(run), *SHRINK, "--set", "data.lanes=1", "--set", "data.global_batch=1",
            "--set", "data.micro_batch=1", "--set", "data.eval_batches=1", "--set", "ckpt_every=10",
            "--set", "ckpt_local_every=1", "--set", f"ckpt_local_dir={tier}"]
    _diverge_at_step_4(monkeypatch)
    assert main([*args, "--set", "steps=4"]) == 2
    monkeypatch.undo()
    crashed = tmp_path / "crashed"
    shutil.copytree(tier, crashed)
    assert main([*args, "--fresh"]) == 2
    assert "(or remove that folder to start over there)" in capsys.readouterr().err
    for fresh in (["--fresh"], []):
        shutil.rmtree(run)  # as the advice says
        assert main([*args, *fresh, "--set", "steps=1"]) == 0
        err = capsys.readouterr().err
        assert "resum" not in err, err
        assert sorted(metrics(run)) == [1] and not (run / "resume-w1-r0.json").exists()
        shutil.rmtree(tier)
        shutil.copytree(crashed, tier)  # the killed run's tier, as it left it


def test_a_failed_final_save_is_an_error_and_keeps_the_fast_tier(tmp_path, capsys, monkeypatch):
    """A run whose last (persistent) save fails ends without that step in the store: it
    says so in one line and exits 2 (saves before it may fail and training goes on), and
    the node's fast-tier folder, whose step 3 is newer than the store's step 2, stays."""
    from flexckpt.format.names import MANIFEST, step_dir
    from flexckpt.storage import Storage
    from flexckpt.tier.inventory import scan
    from flextrain.trainer import Trainer

    run, tier = tmp_path / "run", tmp_path / "tier"
    put = Storage.put_atomic

    def full_disk(self, rel, *a, **k):
        if rel == f"{step_dir(4)}/{MANIFEST}":
            raise OSError(28, "No space left on device (test)")
        return put(self, rel, *a, **k)

    monkeypatch.setattr(Storage, "put_atomic", full_disk)
    gather = Trainer._gather_step

    def waiting(self, *a):
        self.ckpt.tier.wait()  # the previous fast save is done: none is skipped
        return gather(self, *a)

    monkeypatch.setattr(Trainer, "_gather_step", waiting)
    assert main(["train", "--run-dir", str(run), *SHRINK, "--set", "data.lanes=1", "--set", "data.global_batch=1",
                 "--set", "data.micro_batch=1", "--set", "data.eval_batches=1", "--set", "ckpt_every=2",
                 "--set", "ckpt_local_every=1", "--set", f"ckpt_local_dir={tier}", "--set", "steps=4"]) == 2
    assert capsys.readouterr().err == (
        "flextrain: the final checkpoint, step 4, failed: [Errno 28] No space left on device (test); a restart "
        "resumes from step 2 (or the fast tier's newest step, if newer: this node's folder is kept); fix the "
        "storage and rerun: it trains again from there\n")
    assert not (run / "summary-w1-r0.json").exists()  # the run did not end as asked
    assert Checkpointer(str(run / "ckpt"), rank=0, world_size=1, run_id="t", read_only=True).steps() == [2]
    (folder,) = tier.iterdir()  # kept: its newest step is newer than the store's
    assert max(h.step for h in scan(Storage(str(folder)))) == 3


FULL_DISK_ON_RANK_1 = """
import os
if os.environ.get("RANK") == "1":  # this rank's files of the final step fail: the others' are written
    from flexckpt.format.names import step_dir
    from flexckpt.storage import Storage
    put = Storage.put_atomic

    def full_disk(self, rel, *a, **k):
        if rel.startswith(step_dir(2) + "/") and "r00001" in rel:
            raise OSError(28, "No space left on device (test)")
        return put(self, rel, *a, **k)

    Storage.put_atomic = full_disk
"""


def test_a_final_save_failing_on_one_rank_of_two_fails_both_with_their_line(tmp_path):
    """Two ranks (launched as torchrun launches its workers: env:// on a free port, without
    its agent, which would end the other worker as soon as one exits non-zero): rank 1's
    files of the final step fail (a full disk), so the step is not committed. Each rank
    says so in its line, naming its own error, and exits 2; none hangs."""
    import socket

    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(FULL_DISK_ON_RANK_1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "flextrain", "train", "--run-dir", str(run), *SHRINK, "--set", "data.lanes=2",
           "--set", "data.global_batch=2", "--set", "data.micro_batch=1", "--set", "data.eval_batches=1",
           "--set", "ckpt_every=2", "--set", "steps=2"]
    procs = []
    for rank in (0, 1):
        env = dict(ENV, PYTHONPATH=f"{hook}{os.pathsep}{ENV['PYTHONPATH']}", RANK=str(rank), LOCAL_RANK=str(rank),
                   WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        errs = [p.communicate(timeout=120)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    tail = "; a restart resumes from scratch (no committed checkpoint); fix the storage and rerun: it trains again from there\n"
    assert [p.returncode for p in procs] == [2, 2], errs
    assert errs[1].endswith("flextrain: rank 1: the final checkpoint, step 2, failed: [Errno 28] No space left on "
                            "device (test)" + tail), errs[1][-3000:]
    assert errs[0].endswith("flextrain: rank 0: the final checkpoint, step 2, failed: save of step 2 failed on another "
                            "rank: rank 1 failed while writing its chunk table: OSError: [Errno 28] No space left on "
                            "device (test)" + tail), errs[0][-3000:]
    assert Checkpointer(str(run / "ckpt"), rank=0, world_size=1, run_id="t", read_only=True).steps() == []


def test_resuming_a_run_already_at_its_steps_says_there_is_nothing_to_train(tmp_path, capsys):
    """A resume whose checkpoint is at (or past) ``steps`` trains nothing: it says so and
    how to go on, rather than ending without a word."""
    run = tmp_path / "run"
    tiny = ["--run-dir", str(run), *SHRINK, "--set", "data.lanes=1", "--set", "data.global_batch=1",
            "--set", "data.micro_batch=1", "--set", "data.eval_batches=1", "--set", "ckpt_every=1"]
    assert main(["train", *tiny, "--set", "steps=1"]) == 0
    assert "\nflextrain: 1 step on 1 rank, " in "\n" + capsys.readouterr().out
    assert main(["train", *tiny, "--set", "steps=1"]) == 0
    assert capsys.readouterr().err.endswith(
        "flextrain: the checkpoint is at step 1 and steps=1: nothing to train; pass --set steps=N with N > 1 "
        "to train on\n")
    assert sorted(metrics(run)) == [1]


def test_fresh_is_refused_where_an_earlier_run_left_checkpoints(tmp_path, capsys):
    """``--fresh`` over an earlier run's steps would lose: a restart resumes the earlier run's
    newest step, and retention keeps those over the new run's (it removed the new run's own).
    It is refused in one line, and nothing of the earlier run is touched."""
    run = tmp_path / "run"
    with Checkpointer(str(run / "ckpt"), rank=0, world_size=1, run_id="earlier") as ck:
        ck.save(15, {"x": torch.ones(2)}).result()
    assert main(["train", "--run-dir", str(run), "--fresh", *SHRINK, "--set", "steps=1"]) == 2
    assert capsys.readouterr().err == (
        f"flextrain: --fresh: {run / 'ckpt'} holds committed steps up to 15 of an earlier run, which a restart "
        f"would resume from and retention would keep over this run's; pass a new --run-dir (or remove that "
        f"folder to start over there)\n")
    assert Checkpointer(str(run / "ckpt"), rank=0, world_size=1, run_id="t").steps() == [15]
    assert not (run / "metrics.jsonl").exists()


def test_plan_of_a_run_whose_newest_checkpoint_is_damaged_follows_the_resume_to_the_one_before(tmp_path, capsys):
    """``flextrain train`` falls back to the previous step when the newest cannot be read;
    ``flextrain plan`` plans that step too (it stopped with the newest step's error). A plan
    only reads: a stale attempt folder and an empty step folder, which a job's start
    removes, stay."""
    from flexckpt.format.names import MANIFEST, step_dir

    run = tmp_path / "run"
    tiny = ["--run-dir", str(run), *SHRINK, "--set", "data.lanes=2", "--set", "data.global_batch=2",
            "--set", "data.micro_batch=1", "--set", "data.eval_batches=1", "--set", "ckpt_every=1", "--set", "steps=2"]
    assert main(["train", *tiny]) == 0
    (run / "ckpt" / step_dir(2) / MANIFEST).write_bytes(b"{")  # cut short
    stale, empty = run / "ckpt" / step_dir(1) / "old.0000abcd.1", run / "ckpt" / step_dir(3)
    stale.mkdir()
    empty.mkdir()
    os.utime(stale, (1e9, 1e9))  # untouched since 2001
    capsys.readouterr()
    assert main(["plan", str(run), "--world", "2"]) == 0
    assert capsys.readouterr().out.startswith(f"{run}: step 1 saved on 1 rank; resume on 2:\n")
    assert main(["plan", str(run), "--world", "2", "--step", "2"]) == 2  # asked for by number: no other
    assert stale.is_dir() and empty.is_dir()
