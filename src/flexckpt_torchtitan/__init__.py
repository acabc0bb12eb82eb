"""flexckpt and zephon_state inside torchtitan (0.3.0): a checkpoint manager and a data loader.

    from flexckpt_torchtitan import FlexCheckpointManager, ZephonDataLoader

    config.checkpoint = FlexCheckpointManager.Config(enable=True, interval=500, last_save_model_only=False)
    config.training.global_batch_size = 64
    config.dataloader = ZephonDataLoader.Config(dataset_path="/data/train.jsonl", lanes=8, global_batch_size=64)

``last_save_model_only=False`` keeps the last step a full checkpoint that a restart resumes
(torchtitan's default, True, makes it a model-only export); the loader's global batch is the
trainer's ``training.global_batch_size``, given to both.

Package boundary: this package is the only one that imports torchtitan
(torchtitan -> flexckpt_torchtitan -> flexckpt, zephon_state; never back). Importing it
needs torchtitan installed (Python >= 3.11).
"""
import importlib.metadata

__version__ = importlib.metadata.version("flexckpt")  # the distribution's, from pyproject.toml

from flexckpt.integration import require

require("flexckpt_torchtitan", "torchtitan", "torchtitan", " (Python >= 3.11)")  # before any import of it: a missing extra is named

from flexckpt_torchtitan.checkpoint import FlexCheckpointManager
from flexckpt_torchtitan.data import ZephonDataLoader

__all__ = ["__version__", "FlexCheckpointManager", "ZephonDataLoader"]
