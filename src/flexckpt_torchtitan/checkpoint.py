"""flexckpt as torchtitan 0.3.0's checkpoint manager.

In the user's config function (nothing else changes):

    checkpoint=FlexCheckpointManager.Config(enable=True, interval=500, last_save_model_only=False)

Every field of torchtitan's ``CheckpointManager.Config`` is a field here too (so its
command-line overrides parse as before), and each is honoured; ``async_mode``: "async" (the
default) and "async_with_pinned_mem" are flexckpt's save (it stages a GPU's tensors into
pinned host memory in any case), "disabled" waits in ``save()`` until the step is committed.

torchtitan calls ``save(step, last_step)`` after every step (this manager decides whether the
step is saved), ``maybe_wait_for_staging()`` before ``optimizers.step()`` (flexckpt's fence:
the copy of the state is done), ``load(step)`` once before step 1 and ``close()`` at the end.
A save never blocks on storage: ``save_future`` is the last save's commit.

What is saved: the model (``ModelWrapper``: FSDP2 DTensors are saved as flexshard layouts and
load at any world size), the optimizers (torchtitan's flat, FQN-keyed state), the LR schedulers,
the train state and the data loader. A :class:`~flexckpt_torchtitan.data.ZephonDataLoader`
saves its lane cursors by lane, so it resumes at another data-parallel degree. torchtitan's own
loaders save ``{"dp_rank_<d>": pickled bytes, "world_size": dp}``: flexckpt stores the bytes by
key (the TP/PP peers of replica d hold equal copies, stored once) and never unpickles them; that
state resumes only at the data-parallel degree that saved it (any TP/PP layout), else the load
is refused before step 1, naming ZephonDataLoader and ``exclude_from_loading`` as the fixes.
``exclude_from_loading`` is flexckpt's ``load(exclude=...)``: the named states keep what they hold.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torchtitan.components.checkpointer import (
    DATALOADER,
    LR_SCHEDULER,
    MODEL,
    OPTIMIZER,
    TRAIN_STATE,
    BaseCheckpointManager,
    CheckpointManager,
    ModelWrapper,
)
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.tools import filesystem

from flexckpt import Checkpointer, LoadError, SaveHandle
from flexckpt_torchtitan.data import ZephonDataLoader

log = logging.getLogger("flexckpt.torchtitan")


class _CommitFuture(Future):
    """``save_future`` for torchtitan: done when the save is committed on this rank."""

    def __init__(self, handle: SaveHandle) -> None:
        super().__init__()
        self.handle = handle

    def done(self) -> bool:
        return self.handle.done()

    def result(self, timeout: float | None = None) -> int:
        return self.handle.result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self.handle.wait(timeout)
        return self.handle.exception()


def _check_global_batch(loader: ZephonDataLoader, trainer: Any) -> None:
    """The loader's global batch is the trainer's (``training.global_batch_size``, or local batch
    x dp degree when that is -1): else a step's batches and the saved position disagree."""
    training = getattr(getattr(trainer, "config", None), "training", None)
    if training is None:  # not torchtitan's Trainer: nothing to compare with
        return
    topology = loader.topology
    trainer_batch = training.global_batch_size
    if trainer_batch < 0:
        trainer_batch = training.local_batch_size * topology.size
    if trainer_batch != topology.global_batch:
        raise ValueError(
            f"dataloader.global_batch_size={topology.global_batch} differs from the trainer's global batch, "
            f"{trainer_batch} "
            f"(training.global_batch_size={training.global_batch_size}): set both to the same number of rows")


class FlexCheckpointManager(BaseCheckpointManager):
    """torchtitan's ``BaseCheckpointManager`` on flexckpt (see the module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "async"
        """"async" and "async_with_pinned_mem": ``save()`` returns once the copy is queued (GPU
        tensors are staged into pinned memory either way); "disabled": once the step is committed."""

        url: str | None = None
        """Storage URL (file://, s3://...); default: ``folder`` under the dump folder."""

        compression: str | None = None
        """None, "zstd" or "zstd:LEVEL" per chunk."""

        max_in_flight: int = 1
        """Saves staged but not yet written; one more save waits (bounded host memory)."""

        storage_options: str = ""
        """fsspec options for the URL as JSON text, e.g. '{"client_kwargs": {"endpoint_url": "..."}}'."""

    def __init__(
        self,
        config: Config,
        *,
        dataloader: Any,
        model_parts: list[torch.nn.Module],
        optimizers: Any,
        lr_schedulers: Any,
        states: dict[str, Any],
        sd_adapter: Any = None,
        base_folder: str = "",
    ) -> None:
        self.enable = config.enable
        self.save_future: Future | None = None
        if not self.enable:
            return
        self.config = config
        self.base_folder = base_folder
        if config.last_save_in_hf and sd_adapter is None:
            raise ValueError("checkpoint.last_save_in_hf=True needs a model with a state dict adapter; this model has none")
        self.url = config.url or filesystem.join(base_folder, config.folder)
        self.export_dtype = TORCH_DTYPE_MAP[config.export_dtype]
        self.model = ModelWrapper(model_parts)
        self.zephon = isinstance(dataloader, ZephonDataLoader)
        self.states: dict[str, Any] = {
            MODEL: self.model,
            OPTIMIZER: optimizers,
            LR_SCHEDULER: lr_schedulers,
            **states,
        }
        if self.zephon:  # lane cursors as one ByLane value
            _check_global_batch(dataloader, states.get(TRAIN_STATE))
            self.states[DATALOADER] = dataloader.by_lane()
        elif dataloader is not None:  # torchtitan's loaders: {"dp_rank_<d>": bytes, "world_size": dp}, bytes by key
            self.states[DATALOADER] = dataloader
        for key in config.exclude_from_loading:
            if key not in self.states:
                raise ValueError(f"checkpoint.exclude_from_loading names {key!r}; the state has {sorted(self.states)}")
        self._delegate_args = dict(dataloader=dataloader, model_parts=model_parts, optimizers=optimizers,
                                   lr_schedulers=lr_schedulers, states=dict(states), sd_adapter=sd_adapter,
                                   base_folder=base_folder)
        self.ckpt = Checkpointer(
            self.url,
            keep_last=config.keep_latest_k or None,
            compression=config.compression,
            max_in_flight=config.max_in_flight,
            storage_options=json.loads(config.storage_options) if config.storage_options else None,
        )
        self._staging: SaveHandle | None = None
        self.waits: list[float] = []  # seconds the training thread spent per save (save + fence)
        log.info("flexckpt: checkpoints go to %s (every %d steps)", self.url, config.interval)

    # -- the contract torchtitan calls ---------------------------------------------------------
    def _should_save(self, step: int, last_step: bool) -> bool:
        c = self.config
        if c.load_only:
            return False
        return (step == 1 and c.enable_first_step_checkpoint) or last_step or step % c.interval == 0

    @torch.no_grad()
    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if not self._should_save(curr_step, last_step):
            return False
        self._maybe_wait_for_staging()  # torchtitan fences every step; this covers a caller that did not
        if curr_step == 0:  # create_seed_checkpoint: the model alone, as torchtitan saves it
            self._save_and_commit(curr_step, {MODEL: self.model})
            return True
        if last_step and self.config.last_save_in_hf:
            self._delegate(folder=filesystem.join(self.config.folder, "hf"))._save_last_step(curr_step)
            return True
        if last_step and self.config.last_save_model_only:
            model = {k: v.to(self.export_dtype) if torch.is_floating_point(v) and v.dtype != self.export_dtype else v
                     for k, v in self.model.state_dict().items()}
            self._save_and_commit(curr_step, {MODEL: model})
            return True
        if self.config.async_mode == "disabled":
            self._save_and_commit(curr_step, self.states)
            return True
        handle = self.ckpt.save(curr_step, self.states)
        self._staging = handle
        self.save_future = _CommitFuture(handle)
        if last_step:  # torchtitan ends the run right after this: the last save is awaited here
            self._maybe_wait_for_staging()
        return True

    def _save_and_commit(self, step: int, state: dict) -> None:
        handle = self.ckpt.save(step, state)
        handle.result()

    def _maybe_wait_for_staging(self) -> None:
        handle, self._staging = self._staging, None
        if handle is not None:
            handle.wait_staged()
            self.waits.append(handle.trainer_wait)

    def _wait_for_saving(self) -> None:
        future, self.save_future = self.save_future, None
        assert future is not None
        future.result()

    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        c = self.config
        steps = self.ckpt.steps()
        if step != -1 and step not in steps:
            raise FileNotFoundError(f"--checkpoint.load_step={step} is not a committed checkpoint under {self.url}; "
                                    f"committed: {steps}")
        if not steps:
            return self._initial_load()
        chosen = steps[-1] if step == -1 else step
        contents = self.ckpt.contents(chosen)
        model_only = not any(path[0] == TRAIN_STATE for path in contents.plain)
        begin = time.monotonic()
        if model_only and chosen != 0:
            raise LoadError(
                f"step {chosen} under {self.url} is a model-only export (last_save_model_only=True): training ended "
                f"there; load an earlier step with --checkpoint.load_step, or save the last step in full with "
                f"last_save_model_only=False")
        exclude = tuple(c.exclude_from_loading)
        if model_only:
            state: dict[str, Any] = {MODEL: self.model}
        else:
            state = self.states
            if DATALOADER in state and DATALOADER not in exclude:
                self._check_loader_degree(contents.plain)
        got = self.ckpt.load(state, chosen, exclude=exclude)
        log.info("flexckpt: loaded step %d from %s in %.2f s", got, self.url, time.monotonic() - begin)
        return True

    def _check_loader_degree(self, saved_plain: dict[tuple, Any]) -> None:
        """torchtitan's own loader state is per data-parallel rank: it resumes only at the dp
        degree that saved it (its ``world_size`` value). Refused here in one line, before
        torchtitan's own assertion and before the missing-key rule (a larger degree)."""
        loader = self.states[DATALOADER]
        saved = saved_plain.get((DATALOADER, "world_size"))
        degree = getattr(loader, "dp_world_size", None)
        if self.zephon or saved is None or degree is None or saved == degree:
            return
        raise LoadError(
            f"the data loader's state was saved at data-parallel degree {saved} and this run's is {degree}: "
            f"torchtitan's loader state is per dp rank and cannot be resharded; use ZephonDataLoader (lane "
            f"cursors resume at any data-parallel degree dividing the lane count) or set "
            f"checkpoint.exclude_from_loading=['dataloader']")

    def _initial_load(self) -> bool:
        """The folder holds no checkpoint: an initial DCP or HF load, done by torchtitan's own code."""
        c = self.config
        if not c.initial_load_path and not c.initial_load_in_hf:
            log.info("flexckpt: no checkpoint under %s; a fresh start", self.url)
            return False
        delegate = self._delegate(folder=c.folder)
        if c.initial_load_path:
            checkpoint_id = c.initial_load_path
            if not filesystem.isdir(checkpoint_id):
                raise ValueError(f"checkpoint.initial_load_path={checkpoint_id!r} is not a folder")
        else:
            adapter = self._delegate_args["sd_adapter"]
            if adapter is None or not adapter.hf_assets_path:
                raise ValueError("checkpoint.initial_load_in_hf=True without initial_load_path needs model.hf_assets_path")
            checkpoint_id = adapter.hf_assets_path
        states = delegate._states_to_load(c.initial_load_model_only)
        delegate.dcp_load(states, checkpoint_id=checkpoint_id, from_hf=c.initial_load_in_hf,
                          from_quantized=c.initial_load_in_hf_quantized)
        log.info("flexckpt: initial load from %s (torchtitan's DCP reader)", checkpoint_id)
        return True

    def _delegate(self, folder: str) -> CheckpointManager:
        """torchtitan's own manager, synchronous and without retention, for DCP/HF formats."""
        base = {f.name: getattr(self.config, f.name) for f in dataclasses.fields(BaseCheckpointManager.Config)}
        base.update(folder=folder, keep_latest_k=0, enable=True)
        return CheckpointManager(CheckpointManager.Config(**base, async_mode="disabled"), **self._delegate_args)

    def _close(self) -> None:
        if getattr(self, "ckpt", None) is not None:
            self._maybe_wait_for_staging()
            self.ckpt.wait()
            self.ckpt.close()
            self.ckpt = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter teardown
            pass
