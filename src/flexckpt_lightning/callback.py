"""The one line: ``Trainer(callbacks=[FlexCheckpointing()])``.

At ``setup`` it puts :class:`~flexckpt_lightning.checkpoint_io.FlexCheckpointIO` in the
strategy, before Lightning restores ``ckpt_path``; at ``on_fit_start`` it builds the
checkpoint dict once, as Lightning will at the first save, and checks it: a value flexckpt
cannot represent stops the run there, before step 1, naming its key (on every rank alike,
so none waits for another).

Saves are asynchronous by flexckpt's own means (``async_save=True``: Lightning's tensors are
copied out before ``save_checkpoint`` returns). Lightning's ``AsyncCheckpointIO`` is refused:
it queues saves on a thread but runs ``ModelCheckpoint``'s removals at once, so a top-k
removal can run before the queued save of the same path, which then writes it back (seen
here: a removed ``epoch=0-step=4.ckpt`` left behind).
"""
from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning.pytorch.strategies import ModelParallelStrategy

from flexckpt import check_state
from flexckpt_lightning.checkpoint_io import FlexCheckpointIO
from flexckpt_lightning.model_parallel import FlexModelParallelStrategy


def check_checkpoint(checkpoint: dict[str, Any], strategy: Any = None) -> None:
    """Raise ``UnsupportedState`` naming every key of ``checkpoint`` flexckpt cannot save:
    as this rank saves it under :class:`FlexModelParallelStrategy`, else as one process
    saves the whole of it (FlexCheckpointIO)."""
    if isinstance(strategy, FlexModelParallelStrategy):
        check_state(checkpoint, strategy.global_rank, strategy.world_size)
    else:
        check_state(checkpoint)


class FlexCheckpointing(Callback):
    """Lightning checkpoints through flexckpt (see the module docstring).

    Args:
        async_save, checkpointer_options: as :class:`FlexCheckpointIO` takes them.
    """

    def __init__(self, *, async_save: bool = True, **checkpointer_options: Any) -> None:
        self.io = FlexCheckpointIO(async_save=async_save, **checkpointer_options)

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        strategy = trainer.strategy
        if isinstance(strategy, ModelParallelStrategy):
            if not isinstance(strategy, FlexModelParallelStrategy):
                raise TypeError(f"{type(strategy).__name__} saves through DCP, not through a CheckpointIO: use "
                                f"strategy=FlexModelParallelStrategy(...) from flexckpt_lightning instead")
            return  # it saves through flexckpt itself
        current = strategy._checkpoint_io  # None until Lightning fills in its default
        if current is None or type(current) is TorchCheckpointIO:
            strategy.checkpoint_io = self.io
        elif isinstance(current, AsyncCheckpointIO):
            raise TypeError("FlexCheckpointing saves asynchronously itself (async_save=True, the default); "
                            "AsyncCheckpointIO removes top-k checkpoints before its queued saves of them run: drop "
                            "AsyncCheckpointIO from plugins")
        elif not isinstance(current, FlexCheckpointIO):
            raise _other_io(current)

    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        check_checkpoint(trainer._checkpoint_connector.dump_checkpoint(weights_only=False), trainer.strategy)


def _other_io(io: CheckpointIO) -> TypeError:
    return TypeError(f"the Trainer already has a checkpoint plugin, {type(io).__name__}: FlexCheckpointing would "
                     f"replace it; drop one of them")
