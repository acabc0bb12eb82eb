"""flexckpt: async checkpoints with zero collectives on save, loadable at any world size.

    from flexckpt import Checkpointer
    ckpt = Checkpointer("file:///path/run1", keep_last=3)
    handle = ckpt.save(step, state)   # returns after queuing the copy
    handle.wait_staged()              # fence: the state may change after this
    handle.result()                   # committed and durable
    step = ckpt.load(state)           # in place, at any world size

Package boundary: flexckpt uses flexshard's layouts; it never imports the trainer. The names
below, ``flexckpt.tier``, ``flexckpt.restore_plan``, ``flexckpt.rng``, ``flexckpt.integration``
and ``flexckpt.closed_pipe`` are what other packages and tools import; every other module is
internal and may move.
"""
import importlib.metadata

__version__ = importlib.metadata.version("flexckpt")  # the distribution's, from pyproject.toml

from flexckpt.catalog import committed_steps, read_manifest
from flexckpt.checkpointer import Checkpointer, SaveHandle
from flexckpt.errors import (
    CheckpointError,
    ChecksumError,
    LoadError,
    ManifestError,
    MissingFile,
    SaveError,
    StorageError,
    StructureMismatch,
    TooLarge,
    TruncatedFile,
    UnsupportedState,
)
from flexckpt.load.pending import subset_load
from flexckpt.state.structure import check_state
from flexckpt.state.values import ByLane, PerRank
from flexckpt.storage import Storage

__all__ = [
    "__version__",
    "ByLane",
    "CheckpointError",
    "Checkpointer",
    "ChecksumError",
    "LoadError",
    "ManifestError",
    "MissingFile",
    "PerRank",
    "SaveError",
    "SaveHandle",
    "Storage",
    "StorageError",
    "StructureMismatch",
    "TooLarge",
    "TruncatedFile",
    "UnsupportedState",
    "check_state",
    "committed_steps",
    "read_manifest",
    "subset_load",
]
