"""The transformers ``Trainer`` (5.x) with its checkpoints on flexckpt.

    trainer = FlexTrainer(model=model, args=args, train_dataset=ds)   # in place of Trainer(...)

Paths and steps: one flexckpt URL per run (``checkpoint_url``, default
``<output_dir>/flexckpt``), one step per save: ``state.global_step``. ``save_total_limit``
is the Checkpointer's ``keep_last``, and with ``load_best_model_at_end`` the best step is
pinned besides (it survives retention, as the Trainer keeps its best folder). The
``checkpoint-N`` folders stay where the Trainer looks for them (``get_last_checkpoint``,
``resume_from_checkpoint=True`` or a folder's path), each holding ``flexckpt.json`` (the URL
and step N) and ``trainer_state.json``, the Trainer's progress file, which ``Trainer.train``
reads before any method a subclass can override; a folder is written once its step is
committed and removed when retention removes the step.

What a step holds: the model's state dict, the optimizer's, the LR scheduler's, the AMP
scaler's (if any), every process's RNG state (per rank) and the ``TrainerState`` as a plain
dict, no pickle. Resuming restores all of them from the step, the progress (step, epoch,
log history, best metric, stateful callbacks) included.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
from typing import Any

from transformers import Trainer
from transformers.trainer_callback import ExportableState, TrainerState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy, compare_trainer_and_checkpoint_args

from flexckpt import Checkpointer, LoadError
from flexckpt.integration import check_options
from flexckpt.rng import load_rng_state, rng_state

log = logging.getLogger("flexckpt.hf")

POINTER = "flexckpt.json"
_FOLDER = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")


def folder_pointer(folder: str) -> tuple[str, int] | None:
    """The flexckpt URL and step a ``checkpoint-N`` folder stands for, or None for a folder
    the Trainer wrote itself (no ``flexckpt.json``)."""
    try:
        with open(os.path.join(folder, POINTER), encoding="utf-8") as f:
            pointer = json.load(f)
    except FileNotFoundError:
        return None
    return str(pointer["url"]), int(pointer["step"])


def folder_step(folder: str) -> int | None:
    """The flexckpt step a ``checkpoint-N`` folder stands for (see :func:`folder_pointer`)."""
    pointer = folder_pointer(folder)
    return None if pointer is None else pointer[1]


class FlexTrainer(Trainer):
    """``Trainer`` whose checkpoints go through flexckpt (see the module docstring).

    Args:
        checkpoint_url: where the steps go (file path, ``file://``, ``s3://``...); default
            ``<output_dir>/flexckpt``.
        checkpoint_options: passed to the ``Checkpointer`` (``compression``,
            ``storage_options``...); ``keep_last`` comes from ``args.save_total_limit``.
        the rest: as ``Trainer`` takes them.
    """

    def __init__(self, *args: Any, checkpoint_url: str | None = None,
                 checkpoint_options: dict[str, Any] | None = None, **kwargs: Any) -> None:
        options = dict(checkpoint_options or {})
        check_options(options, "FlexTrainer(checkpoint_options=...)")
        super().__init__(*args, **kwargs)
        if "keep_last" in options:
            raise ValueError("FlexTrainer takes keep_last from TrainingArguments.save_total_limit: drop keep_last")
        self.checkpoint_url = checkpoint_url or os.path.join(self.args.output_dir, "flexckpt")
        self._checkpoint_options = options
        self._checkpointer: Checkpointer | None = None
        self._resumed: tuple[str, Checkpointer, dict] | None = None  # (folder, its reader, its step's dict)

    @property
    def checkpointer(self) -> Checkpointer:
        """Opened at the first save or resume, on every process (they save together)."""
        if self._checkpointer is None:
            self._checkpointer = Checkpointer(self.checkpoint_url, keep_last=self.args.save_total_limit,
                                              **self._checkpoint_options)
        return self._checkpointer

    # -- saving ------------------------------------------------------------------------------
    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        if trial is not None:
            raise ValueError("FlexTrainer does not save hyper-parameter search trials; use Trainer for the search")
        self.store_flos()
        run_dir = self.args.output_dir
        step = self.state.global_step
        ckpt = self.checkpointer
        best = self.state.best_global_step
        if best and self.args.save_strategy in (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST):
            if best == step or best in ckpt.steps():
                self.state.best_model_checkpoint = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{best}")
            if self.args.load_best_model_at_end:
                ckpt.pinned = frozenset({best})
        for cb in [c for c in self.callback_handler.callbacks + [self.control] if isinstance(c, ExportableState)]:
            name = cb.__class__.__name__
            if isinstance(self.state.stateful_callbacks[name], list):
                self.state.stateful_callbacks[name].append(cb.state())
            else:
                self.state.stateful_callbacks[name] = cb.state()
        state: dict[str, Any] = {"trainer_state": dataclasses.asdict(self.state),
                                 "model": self.accelerator.unwrap_model(model).state_dict()}
        if not self.args.save_only_model:
            state["optimizer"] = self.optimizer.state_dict()
            state["scheduler"] = self.lr_scheduler.state_dict()
            state["rng"] = rng_state()
            if getattr(self.accelerator, "scaler", None) is not None:
                state["scaler"] = self.accelerator.scaler.state_dict()
        ckpt.save(step, state).result()
        ckpt.wait()  # retention after this commit, too: the folders below follow it
        if self.args.should_save:
            self._write_folders(run_dir, step, ckpt.steps())

    def _write_folders(self, run_dir: str, step: int, committed: list[int]) -> None:
        """``checkpoint-<step>`` for the step just committed; those of steps retention removed go."""
        folder = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")
        os.makedirs(folder, exist_ok=True)
        self.state.save_to_json(os.path.join(folder, "trainer_state.json"))
        with open(os.path.join(folder, POINTER), "w", encoding="utf-8") as f:
            json.dump({"url": self.checkpoint_url, "step": step}, f)
        for name in os.listdir(run_dir):
            match = _FOLDER.match(name)
            path = os.path.join(run_dir, name)
            if match and int(match.group(1)) not in committed and folder_step(path) is not None:
                shutil.rmtree(path)

    # -- resuming ----------------------------------------------------------------------------
    def _saved(self, folder: str | None) -> dict | None:
        """The step ``folder`` stands for, loaded once per resume (None: not a flexckpt folder);
        a folder of another run is read from that run's URL."""
        pointer = None if folder is None else folder_pointer(folder)
        if pointer is None:
            return None
        if self._resumed is None or self._resumed[0] != folder:
            url, step = pointer
            reader = (self.checkpointer if url == self.checkpoint_url
                      else Checkpointer(url, read_only=True, **self._checkpoint_options))
            if step not in reader.steps():
                raise LoadError(f"{folder} stands for step {step} of {url}, which is not committed there; "
                                f"committed: {reader.steps()}")
            self._resumed = (folder, reader, reader.load_dict(step, exclude=("rng",)))  # rng: _load_rng_state
        return self._resumed[2]

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        saved = self._saved(resume_from_checkpoint)
        if saved is None:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        target = self.accelerator.unwrap_model(model if model is not None else self.model)
        target.load_state_dict(saved["model"])

    def _init_training_state(self, max_steps: int, num_update_steps_per_epoch: int, num_train_epochs: int,
                             resume_from_checkpoint: str | None, trial: Any) -> tuple[int, int]:
        saved = self._saved(resume_from_checkpoint)
        if saved is None:
            return super()._init_training_state(max_steps, num_update_steps_per_epoch, num_train_epochs,
                                                resume_from_checkpoint, trial)
        # as Trainer._init_training_state, the progress taken from the step instead of trainer_state.json
        self.state = TrainerState(**saved["trainer_state"])
        best = self.state.best_model_checkpoint
        if best is not None and folder_step(best) not in self.checkpointer.steps():
            self.state.best_model_checkpoint = None
        compare_trainer_and_checkpoint_args(self.args, self.state)
        self._load_callback_state()
        epochs_trained = int(self.state.global_step // num_update_steps_per_epoch)
        steps_in_epoch = 0
        if not self.args.ignore_data_skip:
            steps_in_epoch = (self.state.global_step % num_update_steps_per_epoch) * self.args.gradient_accumulation_steps
        self.state.init_training_references(self, max_steps, num_train_epochs, trial)
        return epochs_trained, steps_in_epoch

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        saved = self._saved(checkpoint)
        if saved is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        if "optimizer" not in saved:
            raise LoadError(f"{checkpoint} was saved with save_only_model=True: it holds the model's weights only (no "
                            f"optimizer, scheduler or RNG state), so training cannot resume from it; resume from a "
                            f"step saved without save_only_model, or start a new run from its weights "
                            f"(Checkpointer(url, read_only=True).load_dict(step)['model'])")
        self.optimizer.load_state_dict(saved["optimizer"])
        self.lr_scheduler.load_state_dict(saved["scheduler"])

    def _load_scaler(self, checkpoint: str | None) -> None:
        saved = self._saved(checkpoint)
        if saved is None:
            return super()._load_scaler(checkpoint)
        if "scaler" in saved and getattr(self.accelerator, "scaler", None) is not None:
            self.accelerator.scaler.load_state_dict(saved["scaler"])

    def _load_rng_state(self, checkpoint: str | None) -> None:
        saved = self._saved(checkpoint)
        if saved is None:
            return super()._load_rng_state(checkpoint)
        step = folder_step(checkpoint)
        if not load_rng_state(self._resumed[1], step):
            log.warning("flexckpt: step %d holds no RNG states of this number of processes: they stay as seeded", step)

    def _load_best_model(self) -> None:
        step = folder_step(self.state.best_model_checkpoint)
        if step is None:
            return super()._load_best_model()
        saved = self.checkpointer.load_dict(step, exclude=("optimizer", "scheduler", "scaler", "rng"))
        self.accelerator.unwrap_model(self.model).load_state_dict(saved["model"])
