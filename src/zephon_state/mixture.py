"""The plan: which sources, in which token proportions. Processing (tokenize, pack, shuffle,
batch) is configured apart from it, so either can change alone.

``Mix`` is what the user writes; ``Plan`` is the resolved form the lanes read: the loaded
documents of each source in order, the exact token shares, and the calibration (tokens per
byte of each source, measured on a sample unless given), which sizes how far ahead each
source is tokenized.
"""
from __future__ import annotations

import math
from fractions import Fraction
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from .calibrate import tokens_per_byte
from .errors import ConfigError
from .mix import exact_shares
from .shuffle import epoch_order, phase_key
from .source import BadRecordPolicy, Documents, as_source
from .storage import IoOptions
from .tokenize import LoadedTokenizer, TokenizerPool

UNCALIBRATED_TOKENS_PER_BYTE = 0.25  # sizes a lone source's readahead; decides no batch


@dataclass(frozen=True)
class Mix:
    """Several sources mixed by target *token* shares (not sample counts).

    ``shares`` are positive weights (normalised to sum to 1); every window of every lane holds
    each source's exact token quota (see ``mix.py``). ``calibration`` gives each source's
    tokens per byte; when it is None the pipeline measures it by tokenizing about
    ``calibration_bytes`` of each source, drawn in a fixed order, before training, and uses it
    to tokenize each source ahead in proportion to its quota.
    """

    sources: Mapping[str, Any]
    shares: Mapping[str, float]
    calibration: Mapping[str, float] | None = None
    calibration_bytes: int = 1 << 18

    def __post_init__(self) -> None:
        names = list(self.sources)
        if not names:
            raise ConfigError("Mix needs at least one source")
        if set(self.shares) != set(names):
            raise ConfigError(
                f"Mix shares name {sorted(self.shares)} but the sources are {sorted(names)}; "
                "give one share per source"
            )
        for name, share in self.shares.items():
            if not isinstance(share, (int, float)) or not math.isfinite(share) or share <= 0:
                raise ConfigError(f"Mix share of {name!r} is {share!r}; shares must be positive numbers")
        if self.calibration is not None:
            if set(self.calibration) != set(names):
                raise ConfigError(f"Mix calibration must give tokens per byte for exactly {sorted(names)}")
            for name, tpb in self.calibration.items():
                if not isinstance(tpb, (int, float)) or not tpb > 0:
                    raise ConfigError(f"Mix calibration of {name!r} is {tpb!r}; it must be a positive tokens/byte")
        if self.calibration_bytes < 1:
            raise ConfigError(f"Mix calibration_bytes={self.calibration_bytes} must be positive")
        object.__setattr__(self, "sources", {name: as_source(src) for name, src in self.sources.items()})

    def weights(self) -> tuple[float, ...]:
        """The shares as given, in source order."""
        return tuple(float(self.shares[n]) for n in self.sources)


def as_mix(value: Any) -> Mix:
    """A one-source ``Mix`` from a single source."""
    if isinstance(value, Mix):
        return value
    source = as_source(value)
    return Mix({source.name: source}, {source.name: 1.0})


@dataclass(frozen=True, eq=False)
class Plan:
    """The resolved plan: documents of each source, exact token shares, tokens per byte,
    and the seed words of every document order."""

    names: tuple[str, ...]
    documents: tuple[Documents, ...]
    shares: tuple[Fraction, ...]
    tokens_per_byte: tuple[float, ...]
    seed: int
    phase: int
    _orders: "OrderedDict[tuple[int, int], np.ndarray]" = field(default_factory=OrderedDict, repr=False)

    def check(self, lanes: int, window_tokens: int) -> None:
        """Every lane needs a document of every source per epoch, and every window at least
        one token of every source."""
        for name, docs, share in zip(self.names, self.documents, self.shares):
            if len(docs) < lanes:
                raise ConfigError(
                    f"source {name!r} has {len(docs)} documents but lanes={lanes}: every lane needs at "
                    "least one document of every source per epoch; use fewer lanes or more documents"
                )
            if len(docs) and not docs.report.bytes:
                raise ConfigError(
                    f"source {name!r} has {len(docs)} documents but every one is empty: there is no text to "
                    "train on; check the source's text field, or remove the source"
                )
            if window_tokens * share < 1:
                raise ConfigError(
                    f"source {name!r} has share {float(share):.3g} of a {window_tokens}-token window, less than "
                    "one token; raise its share or the window (shuffle buffer_size or pack_flat window)"
                )

    def order(self, source: int, epoch: int) -> np.ndarray:
        """Source ``source``'s document order in ``epoch`` (a few recent ones are kept)."""
        key = (source, epoch)
        found = self._orders.get(key)
        if found is None:
            found = epoch_order(self.seed, self.phase, source, epoch, len(self.documents[source]))
            self._orders[key] = found
            if len(self._orders) > 4 * len(self.documents):
                self._orders.popitem(last=False)
        else:
            self._orders.move_to_end(key)
        return found

    def text(self, source: int, index: int) -> str:
        return self.documents[source].texts[index]



def resolve(
    mix: Mix,
    field_name: str,
    io: IoOptions,
    policy: BadRecordPolicy,
    tokenizer: LoadedTokenizer,
    pool: TokenizerPool,
    seed: int,
    phase: str,
) -> Plan:
    """Load every source and calibrate the mix (a lone source needs no calibration)."""
    docs = tuple(src.load(field_name, io, policy) for src in mix.sources.values())
    names = tuple(mix.sources)
    if mix.calibration is not None:
        tpb = tuple(float(mix.calibration[n]) for n in names)
    elif len(names) == 1:
        tpb = (UNCALIBRATED_TOKENS_PER_BYTE,)
    else:
        tpb = tuple(tokens_per_byte(d, tokenizer, pool, mix.calibration_bytes) for d in docs)
    return Plan(names, docs, exact_shares(mix.weights()), tpb, seed, phase_key(phase))
