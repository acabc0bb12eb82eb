"""Lightning's ``ModelParallelStrategy`` (FSDP2 / tensor parallel) on flexckpt.

Lightning's sharded strategies bypass ``CheckpointIO`` and call DCP themselves, so this is a
subclass: ``Trainer(strategy=FlexModelParallelStrategy(...))`` in place of
``ModelParallelStrategy(...)``, the same arguments.

Every rank saves its shards: the model's and optimizers' state dicts hold DTensors, which
flexckpt stores as layouts (no gather), and the rest of Lightning's checkpoint dict (loops,
callbacks, hyper-parameters) as plain values. A checkpoint path is a flexckpt URL holding one
step, the ``global_step``, as with :class:`~flexckpt_lightning.checkpoint_io.FlexCheckpointIO`.
The load reads each rank's pieces into the state dicts of the model and optimizers as they
are sharded now, so a run resumes at another number of ranks or another dp x tp mesh.
"""
from __future__ import annotations

import os
from typing import Any

from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ModelParallelStrategy

from flexckpt import Checkpointer, LoadError
from flexckpt.integration import check_options
from flexckpt_lightning.checkpoint_io import checkpoint_step

SHARDED = ("state_dict", "optimizer_states")  # the keys the load reads into the live sharded state


class FlexModelParallelStrategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` whose checkpoints go through flexckpt (see the module docstring).

    Args:
        checkpoint_options: passed to each path's ``Checkpointer`` (``compression``,
            ``storage_options``...); ``keep_last`` is 1, a path holds one checkpoint.
        the rest: as ``ModelParallelStrategy`` takes them (``save_distributed_checkpoint``
            must stay True: each rank saves its own shards).
    """

    def __init__(self, *args: Any, checkpoint_options: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not self._save_distributed_checkpoint:
            raise ValueError("FlexModelParallelStrategy saves each rank's shards (no gather on rank 0): drop "
                             "save_distributed_checkpoint=False")
        self.checkpoint_options = dict(checkpoint_options or {})
        check_options(self.checkpoint_options, "FlexModelParallelStrategy(checkpoint_options=...)")

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("FlexModelParallelStrategy takes storage options as checkpoint_options=..., not per save")
        url = self.broadcast(os.fspath(filepath))  # rank 0's path for everyone
        ckpt = Checkpointer(url, keep_last=1, **self.checkpoint_options)
        try:
            ckpt.save(checkpoint_step(checkpoint), checkpoint).result()
        finally:
            ckpt.close()

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        url = self.broadcast(os.fspath(checkpoint_path))
        if os.path.isfile(url):
            raise LoadError(f"{url} is a file, not a flexckpt checkpoint folder (flexckpt never unpickles)")
        assert self.model is not None and self.lightning_module is not None
        optimizers = [o._optimizer if isinstance(o, LightningOptimizer) else o for o in self.optimizers]
        sharded = {
            "state_dict": get_model_state_dict(self.model),
            "optimizer_states": [get_optimizer_state_dict(self.model, o) for o in optimizers],
        }
        reader = Checkpointer(url, read_only=True, **self.checkpoint_options)
        try:
            steps = reader.steps()
            if not steps:
                raise LoadError(f"{url} holds no committed checkpoint")
            # the rest whole (loops, callbacks, hyper-parameters), then everything in place: the
            # sharded state into this run's DTensors, at any number of ranks
            rest = reader.load_dict(steps[-1], exclude=SHARDED)
            reader.load({**rest, **sharded}, steps[-1], strict=self.lightning_module.strict_loading)
        finally:
            reader.close()
        set_model_state_dict(self.model, sharded["state_dict"])
        for optimizer, state in zip(optimizers, sharded["optimizer_states"]):
            set_optimizer_state_dict(self.model, optimizer, optim_state_dict=state)
        return rest
