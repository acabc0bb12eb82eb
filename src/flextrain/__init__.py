"""flextrain: the minimal trainer that hosts zephon_state, shards with flexshard and
checkpoints with flexckpt, and resumes at any world size with the same global batches.

    flextrain train --preset tiny --run-dir runs/r1          # or: torchrun --nproc-per-node 2 -m flextrain train ...
    flextrain plan runs/r1 --world 4 --batches 3

Package boundary: flextrain -> flexckpt, flexshard, zephon_state -> torch; never the reverse.
"""
import importlib.metadata

__version__ = importlib.metadata.version("flexckpt")  # the distribution's, from pyproject.toml

from flextrain.config import DataConfig, ModelConfig, OptimConfig, TrainConfig, load_config

__all__ = ["__version__", "DataConfig", "ModelConfig", "OptimConfig", "TrainConfig", "load_config"]
