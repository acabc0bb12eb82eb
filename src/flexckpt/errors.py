"""Exceptions a user can act on."""
from __future__ import annotations


class CheckpointError(RuntimeError):
    """Base class for flexckpt errors."""


class ManifestError(CheckpointError, ValueError):
    """A manifest or record is malformed or points outside what it describes."""


class SaveError(CheckpointError):
    """A save failed; raised by ``SaveHandle.result()``, never into the training loop."""


class LoadError(CheckpointError):
    """A load failed on this rank or another one."""


class StructureMismatch(CheckpointError):
    """The state to load into does not have the structure of the checkpoint."""


class ChecksumError(LoadError):
    """Stored bytes do not match the checksum recorded for them."""


class MissingFile(LoadError, FileNotFoundError):
    """A file a committed checkpoint names is not there (deleted, or never written)."""


class TruncatedFile(LoadError, EOFError):
    """A file of a committed checkpoint ends before the bytes its manifest or table names."""


class TooLarge(CheckpointError, ValueError):
    """A metadata file is bigger than flexckpt reads for that kind of file."""
