"""What replaces Accelerate's ``save_state`` / ``load_state``: every object the Accelerator
prepared, its RNG states and the data loader's position, through flexckpt, no pickle.

    ckpt = AcceleratorCheckpoint(accelerator, "runs/r1/ckpt", keep_last=2)   # after prepare()
    step = ckpt.load()                           # 0 on a fresh start
    for epoch in range(ckpt.epoch, epochs):
        for batch in ckpt.batches(train_loader, epoch):   # the epoch, less what was done
            ...                                  # forward, backward, optimizer.step()
            step += 1
            if step % 100 == 0:
                ckpt.save(step)

Paths and steps: one flexckpt URL per run, one step per save (the caller's step). What a step
holds: each prepared model's state dict (unwrapped), each optimizer's and scheduler's, the
objects given to ``register_for_checkpointing``, the AMP scaler's, each process's RNG states
(per rank) and the position: the epoch and the batches done in it, counted by
:meth:`AcceleratorCheckpoint.batches`. Every process saves (no gather; the replicated
weights are written once, split across processes).

At another number of processes: models, optimizers and schedulers load as they are (their
states are whole on every process under DDP); the position is kept in samples and resumes
where the global batch (per-process batch x processes) divides it, which it does when the
global batch is kept; the RNG states, being per process, stay as seeded (logged). The order
of samples is the same at any count with a seeded sampler (``use_seedable_sampler=True``),
Accelerate's own condition for a reproducible resume.
"""
from __future__ import annotations

import logging
from typing import Any, Iterable, Iterator

from accelerate import Accelerator
from accelerate.data_loader import skip_first_batches

from flexckpt import Checkpointer, LoadError, SaveHandle
from flexckpt.rng import load_rng_state, rng_state

log = logging.getLogger("flexckpt.accelerate")


def global_batch(loader: Any) -> int:
    """Samples one step of ``loader`` takes over all processes."""
    total = getattr(loader, "total_batch_size", None)
    if total is None:
        raise TypeError(f"{type(loader).__name__} is not a data loader from accelerator.prepare(): prepare it first")
    return int(total)


def resume_batches(samples: int, total: int) -> int:
    """Batches of ``total`` samples that cover ``samples`` done; refused when they do not."""
    if samples % total:
        raise LoadError(f"the checkpoint is {samples} samples into its epoch, which is not a whole number of global "
                        f"batches of {total} (per-process batch x processes): keep the global batch of the run "
                        f"that saved it, or resume at an epoch boundary")
    return samples // total


class AcceleratorCheckpoint:
    """Checkpoints of everything ``accelerator`` prepared (see the module docstring).

    Args:
        accelerator: the ``Accelerator``, after ``prepare()``.
        url: where the steps go (path, ``file://``, ``s3://``...).
        checkpointer_options: passed to ``Checkpointer`` (``keep_last``, ``compression``...).
    """

    def __init__(self, accelerator: Accelerator, url: str, **checkpointer_options: Any) -> None:
        self.accelerator = accelerator
        self.checkpointer = Checkpointer(url, **checkpointer_options)
        self.epoch = 0  # the epoch to (re)start
        self._resume_samples = 0  # samples of that epoch done before a resume
        self._done = 0  # batches of the current epoch given out by batches()
        self._total = 0  # global batch of the loader batches() iterates

    # -- position --------------------------------------------------------------------------------
    def batches(self, loader: Any, epoch: int) -> Iterable[Any]:
        """The batches of ``epoch`` still to do: all of them, or, in the epoch a load resumed
        into, those after the position saved. Counts what it gives out (the saved position)."""
        self._total = global_batch(loader)
        skip = resume_batches(self._resume_samples, self._total) if epoch == self.epoch else 0
        self.epoch, self._resume_samples, self._done = epoch, 0, skip
        loader.set_epoch(epoch)
        return self._count(skip_first_batches(loader, skip) if skip else loader)

    def _count(self, loader: Iterable[Any]) -> Iterator[Any]:
        for batch in loader:
            self._done += 1
            yield batch

    # -- save and load ---------------------------------------------------------------------------
    def state(self, step: int) -> dict[str, Any]:
        """The state one step saves."""
        acc = self.accelerator
        state: dict[str, Any] = {
            "models": [acc.unwrap_model(m).state_dict() for m in acc._models],
            "optimizers": [o.state_dict() for o in acc._optimizers],
            "schedulers": [s.state_dict() for s in acc._schedulers],
            "custom": [obj.state_dict() for obj in acc._custom_objects],
            "progress": {"step": step, "epoch": self.epoch, "samples": self._done * self._total},
            "rng": rng_state(),
        }
        if acc.scaler is not None:
            state["scaler"] = acc.scaler.state_dict()
        return state

    def save(self, step: int) -> SaveHandle:
        """Save ``step``; returns once the state is copied out (``handle.result()`` waits
        for the commit). Call it after ``optimizer.step()``, on every process."""
        handle = self.checkpointer.save(step, self.state(step))
        handle.wait_staged()  # the model and optimizer may change once this returns
        return handle

    def load(self, step: int | None = None) -> int:
        """Restore the newest committed step (or ``step``) on every process; returns its
        step, or 0 when there is none (a fresh start)."""
        steps = self.checkpointer.steps()
        if step is None and not steps:
            return 0
        saved = self.checkpointer.load_dict(steps[-1] if step is None else step, exclude=("rng",))
        acc = self.accelerator
        for kind, objects in (("models", [acc.unwrap_model(m) for m in acc._models]), ("optimizers", acc._optimizers),
                              ("schedulers", acc._schedulers), ("custom", acc._custom_objects)):
            if len(saved[kind]) != len(objects):
                raise LoadError(f"the checkpoint holds {len(saved[kind])} {kind} and this Accelerator prepared "
                                f"{len(objects)}: prepare the same ones, in the same order")
            for obj, state in zip(objects, saved[kind]):
                obj.load_state_dict(state)
        if "scaler" in saved and acc.scaler is not None:
            acc.scaler.load_state_dict(saved["scaler"])
        progress = saved["progress"]
        if not load_rng_state(self.checkpointer, progress["step"]):
            log.warning("flexckpt: step %d was saved by another number of processes: RNG states stay as seeded",
                        progress["step"])
        self.epoch, self._resume_samples = progress["epoch"], progress["samples"]
        return progress["step"]

    def close(self) -> None:
        """Wait for the saves in flight and stop the background threads."""
        self.checkpointer.close()
