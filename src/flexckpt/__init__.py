"""flexckpt: async checkpoints with zero collectives on save, loadable at any world size.

    from flexckpt import Checkpointer
    ckpt = Checkpointer("file:///path/run1", keep_last=3)
    handle = ckpt.save(step, state)   # returns after queuing the copy
    handle.wait_staged()              # fence: the state may change after this
    handle.result()                   # committed and durable
    step = ckpt.load(state)           # in place, at any world size

Package boundary: flexckpt uses flexshard's layouts; it never imports the trainer.
"""
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
from flexckpt.values import ByLane, PerRank

__all__ = [
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
    "StorageError",
    "StructureMismatch",
    "TooLarge",
    "TruncatedFile",
    "UnsupportedState",
]
