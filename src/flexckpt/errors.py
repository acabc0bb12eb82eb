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


class StorageError(CheckpointError, OSError):
    """The store under a checkpoint's URL cannot be used (no credentials, credentials
    refused, no such bucket, an endpoint that does not answer): raised in place of the
    backend's own exception (botocore's, say), naming the URL and the cause. An ``OSError``,
    so that code catching a failing disk catches it too."""


class ChecksumError(LoadError):
    """Stored bytes do not match the checksum recorded for them."""


class MissingFile(LoadError, FileNotFoundError):
    """A file a committed checkpoint names is not there (deleted, or never written)."""


class TruncatedFile(LoadError, EOFError):
    """A file of a committed checkpoint ends before the bytes its manifest or table names."""


class TooLarge(CheckpointError, ValueError):
    """A metadata file is bigger than flexckpt reads for that kind of file."""


class UnsupportedState(CheckpointError, TypeError, ValueError):
    """Leaves of a state that cannot be checkpointed, all of them in one error (raised by
    ``Checkpointer.check``, and by ``save``/``load`` on the calling thread). ``problems``
    holds ``(leaf name, the exception its conversion raised)`` for each."""

    def __init__(self, problems: list[tuple[str, BaseException]]) -> None:
        self.problems = list(problems)
        if len(self.problems) == 1:
            name, exc = self.problems[0]
            message = str(exc) if name in str(exc) else f"{name}: {exc}"
        else:
            lines = "".join(f"\n  - {name}: {exc}" for name, exc in self.problems)
            message = f"{len(self.problems)} leaves of the state cannot be checkpointed:{lines}"
        super().__init__(message)


def expected_failure(exc: BaseException) -> bool:
    """A failure of storage or of the checkpoint itself, which its one-line message
    explains (logged without a traceback); anything else may be a bug (logged with one)."""
    return isinstance(exc, (CheckpointError, OSError, TimeoutError))
