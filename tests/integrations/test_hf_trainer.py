"""flexckpt in the transformers Trainer (5.x), CPU, a tiny GPT-2 made here (nothing downloaded):

- a run stopped after step 5 (mid-epoch; its last save step 4) and resumed with ``resume_from_checkpoint=True`` logs the
  uninterrupted run's losses and ends with its step, epoch, scheduler and weights;
- ``checkpoint-N`` folders follow the committed steps; ``save_total_limit`` is ``keep_last``
  and the best step (``load_best_model_at_end``) survives it; nothing is pickled;
- opt-in (``python3 dev.py test-trainers``): the same on 2 processes (torchrun's environment,
  gloo), every process saving.
"""
from __future__ import annotations

import os
import socket

import pytest

pytest.importorskip("transformers", reason="transformers is not installed (pip install -e .[hf])")
pytest.importorskip("accelerate", reason="the transformers Trainer needs accelerate (pip install -e .[hf])")

import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments  # noqa: E402
from transformers.trainer_utils import get_last_checkpoint  # noqa: E402

from flexckpt_hf import FlexTrainer, folder_step  # noqa: E402
from flexshard.spawn import run_workers  # noqa: E402

TWO_PROCESSES = pytest.mark.skipif(os.environ.get("FLEXCKPT_TRAINERS_MATRIX") != "1",
                                   reason="the 2-process Trainer run: python3 dev.py test-trainers")


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2, bos_token_id=0,
                                      eos_token_id=0))


def rows(n: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (n, 12), generator=g)
    return [{"input_ids": r, "labels": r} for r in ids]


class StopAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def trainer(out: str, stop_at: int | None = None) -> FlexTrainer:
    args = TrainingArguments(
        output_dir=out, use_cpu=True, report_to=[], seed=0, per_device_train_batch_size=2, num_train_epochs=2,
        learning_rate=1e-2, lr_scheduler_type="linear", warmup_steps=2, logging_steps=1, save_strategy="steps",
        save_steps=2, eval_strategy="steps", eval_steps=2, save_total_limit=2, load_best_model_at_end=True,
        metric_for_best_model="eval_loss", greater_is_better=True, disable_tqdm=True, dataloader_num_workers=0)
    # greater_is_better on the eval loss: the best is step 6 (its eval loss peaks), older than keep_last=2 keeps
    return FlexTrainer(model=tiny_gpt2(), args=args, train_dataset=rows(12, 1), eval_dataset=rows(4, 2),
                       callbacks=[StopAt(stop_at)] if stop_at else None)


def losses(t: FlexTrainer) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in t.state.log_history if "loss" in h}


def pickled_files(root) -> list[str]:
    return [f for _, _, files in os.walk(root) for f in files
            if f.endswith((".bin", ".pkl", ".pth", ".pt", ".safetensors"))]


def test_trainer_stopped_mid_epoch_and_resumed_matches_the_uninterrupted_run(tmp_path):
    full = trainer(str(tmp_path / "full"))
    full.train()
    cut = trainer(str(tmp_path / "cut"), stop_at=5)  # saves at 2 and 4; steps 5 then runs, unsaved
    cut.train()
    assert cut.state.global_step == 5
    assert get_last_checkpoint(str(tmp_path / "cut")) == str(tmp_path / "cut" / "checkpoint-4")
    resumed = trainer(str(tmp_path / "cut"))
    resumed.train(resume_from_checkpoint=True)

    assert len(losses(full)) == 12  # 2 epochs of 6 steps
    assert {s: v for s, v in losses(resumed).items() if s > 4} == {s: v for s, v in losses(full).items() if s > 4}
    assert (resumed.state.global_step, resumed.state.epoch) == (full.state.global_step, full.state.epoch) == (12, 2.0)
    assert resumed.lr_scheduler.state_dict() == full.lr_scheduler.state_dict()
    assert resumed.state.best_global_step == full.state.best_global_step == 6
    last = [t.checkpointer.load_dict(12) for t in (full, resumed)]
    assert [(d["trainer_state"]["global_step"], d["trainer_state"]["epoch"]) for d in last] == [(12, 2.0)] * 2
    assert last[0]["scheduler"] == last[1]["scheduler"] and last[0]["scheduler"]["last_epoch"] == 12
    for name, value in last[0]["model"].items():
        assert torch.equal(value, last[1]["model"][name]), name  # the same weights at the last step
    best = full.checkpointer.load_dict(6)["model"]
    for name, value in resumed.model.state_dict().items():
        assert torch.equal(value, best[name]), name  # load_best_model_at_end: step 6's weights

    # keep_last=2 keeps 10 and 12, and the best step, 6, besides; the folders follow
    assert full.checkpointer.steps() == resumed.checkpointer.steps() == [6, 10, 12]
    assert sorted(n for n in os.listdir(tmp_path / "full") if n.startswith("checkpoint-")) == [
        "checkpoint-10", "checkpoint-12", "checkpoint-6"]
    assert folder_step(str(tmp_path / "full" / "checkpoint-10")) == 10
    # another run resumes from this run's folder: read from the URL the folder names
    other = trainer(str(tmp_path / "other"))
    other.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-10"))
    assert {s: v for s, v in losses(other).items() if s > 10} == {s: v for s, v in losses(full).items() if s > 10}
    assert other.checkpointer.steps() == [12] and other.state.global_step == 12
    assert pickled_files(tmp_path) == []


def two_process_runs(rank: int, world: int, root: str, port: int) -> tuple:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    full = trainer(os.path.join(root, "full"))
    full.train()
    cut = trainer(os.path.join(root, "cut"), stop_at=3)  # 3 steps an epoch at 2 x 2 rows: saved at 2
    cut.train()
    resumed = trainer(os.path.join(root, "cut"))
    resumed.train(resume_from_checkpoint=True)
    return losses(full), losses(resumed), resumed.state.global_step, resumed.lr_scheduler.state_dict()


@TWO_PROCESSES
def test_two_processes_stopped_and_resumed_match_the_uninterrupted_run(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    per_rank = run_workers(two_process_runs, 2, str(tmp_path), port, backend="none", timeout=400)
    for full, resumed, step, scheduler in per_rank:
        assert len(full) == 6 and resumed == full and step == 6
    assert per_rank[0][3] == per_rank[1][3]
    assert pickled_files(tmp_path) == []


def test_a_misspelt_checkpoint_option_is_refused_when_the_trainer_is_made_not_at_its_first_save(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    with pytest.raises(TypeError, match=r"^FlexTrainer\(checkpoint_options=...\): 'compresion' is not a Checkpointer "
                                        r"option; it takes keep_last, compression, "):
        FlexTrainer(model=tiny_gpt2(), args=args, checkpoint_options={"compresion": "zstd"})


def test_resuming_from_a_save_only_model_step_is_refused_in_one_line_naming_why(tmp_path):
    from flexckpt import LoadError

    def run(steps: int) -> FlexTrainer:
        args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], save_only_model=True,
                                 max_steps=steps, save_steps=2, per_device_train_batch_size=2, disable_tqdm=True)
        return FlexTrainer(model=tiny_gpt2(), args=args, train_dataset=rows(8, 1))

    run(2).train()
    with pytest.raises(LoadError, match=r"checkpoint-2 was saved with save_only_model=True: it holds the model's "
                                        r"weights only .* training cannot resume from it; "):
        run(4).train(resume_from_checkpoint=True)  # before: KeyError: 'optimizer'
