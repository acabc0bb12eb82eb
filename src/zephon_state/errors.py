"""The exceptions the pipeline raises; each message names the value, the limit and the fix."""
from __future__ import annotations


class ZephonError(Exception):
    """Base class of every error raised by zephon_state."""


class ConfigError(ZephonError, ValueError):
    """A setting is invalid or settings contradict each other (found at start, before any data moves)."""


class BadRecordError(ZephonError, ValueError):
    """A source record is unusable and the bad-record policy is "raise"."""


class TokenizerNotFound(ZephonError, LookupError):
    """A tokenizer id resolves neither to the bundled vocabularies, nor a local file, nor the hub."""


class StateError(ZephonError, ValueError):
    """A state dict cannot be loaded: wrong format, other data plan, or missing lanes."""


class FingerprintMismatch(StateError):
    """The saved data plan differs from this pipeline's in something that decides the batches."""
