"""The exceptions the pipeline raises; each message names the value, the limit and the fix."""
from __future__ import annotations

import reprlib

_SHORT = reprlib.Repr()
_SHORT.maxstring, _SHORT.maxother, _SHORT.maxlong = 60, 60, 40


def short(value: object) -> str:
    """A bounded repr of an untrusted value for an error message (never deep, never long)."""
    return _SHORT.repr(value)


class ZephonError(Exception):
    """Base class of every error raised by zephon_state."""


class ConfigError(ZephonError, ValueError):
    """A setting is invalid or settings contradict each other (found at start, before any data moves)."""


class BadRecordError(ZephonError, ValueError):
    """A source record is unusable and the bad-record policy is "raise"."""


class SourceError(ZephonError, ValueError):
    """A source file is damaged (a compressed stream that fails or is cut short): the message
    names the file and the byte offset."""


class TokenizerNotFound(ZephonError, LookupError):
    """A tokenizer id resolves neither to the bundled vocabularies, nor a local file, nor the hub."""


class StateError(ZephonError, ValueError):
    """A state dict cannot be loaded: wrong format, other data plan, or missing lanes."""


class FingerprintMismatch(StateError):
    """The saved data plan differs from this pipeline's in something that decides the batches."""
