"""flexckpt inside PyTorch Lightning (2.6): checkpoints with no pickle, one line.

    from flexckpt_lightning import FlexCheckpointing, FlexModelParallelStrategy

    trainer = Trainer(callbacks=[FlexCheckpointing()])            # single device, DDP
    trainer = Trainer(strategy=FlexModelParallelStrategy(...), callbacks=[FlexCheckpointing()])  # FSDP2 / TP

Package boundary: this package is the only one that imports Lightning
(lightning -> flexckpt_lightning -> flexckpt; never back). See docs/integrations/lightning.md.
"""
import importlib.metadata

__version__ = importlib.metadata.version("flexckpt")  # the distribution's, from pyproject.toml

from flexckpt.integration import require

require("flexckpt_lightning", "lightning", "lightning")  # before any import of it: a missing extra is named

from flexckpt_lightning.callback import FlexCheckpointing, check_checkpoint
from flexckpt_lightning.checkpoint_io import FlexCheckpointIO
from flexckpt_lightning.model_parallel import FlexModelParallelStrategy

__all__ = ["__version__", "FlexCheckpointIO", "FlexCheckpointing", "FlexModelParallelStrategy", "check_checkpoint"]
