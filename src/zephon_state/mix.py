"""Token quotas: how many tokens of each source a lane's window holds.

Shares are exact fractions. After ``n`` tokens, the sources' cumulative allotments are the
differences of ``floor(n * (p_0 + ... + p_s))``: each is within one token of ``n * p_s``,
they sum to exactly ``n``, and each grows with ``n`` (when a window gives every source at
least one token). Window ``k`` of ``B`` tokens targets the allotments at ``(k+1) * B``, so
the realised token shares of a lane are exact at every window end (``wrap``) or within one
piece of at most ``max_length`` tokens (``best_fit``, which keeps documents whole), whatever
the documents' sizes.
"""
from __future__ import annotations

from fractions import Fraction
from typing import Sequence


def exact_shares(weights: Sequence[float]) -> tuple[Fraction, ...]:
    """Positive weights as exact fractions summing to 1."""
    exact = [Fraction(w) for w in weights]
    total = sum(exact)
    return tuple(w / total for w in exact)


def allotment(n: int, shares: Sequence[Fraction]) -> tuple[int, ...]:
    """Each source's cumulative token allotment after ``n`` tokens."""
    out, before, cumulative = [], 0, Fraction(0)
    for p in shares:
        cumulative += p
        upto = (n * cumulative.numerator) // cumulative.denominator
        out.append(upto - before)
        before = upto
    return tuple(out)
