"""Calibration: tokens per byte of a source, measured by tokenizing a fixed sample of it.

The mixer chooses documents by their *estimated* token counts (bytes times tokens per byte)
before they are tokenized, which is what lets tokenization run ahead on parallel workers while
the document order stays a pure function of the plan.
"""
from __future__ import annotations

import threading

import numpy as np

from .shuffle import calibration_order
from .source import Documents
from .tokenize import LoadedTokenizer, TokenizerPool

_memo: dict[tuple[str, str, int], float] = {}
_memo_lock = threading.Lock()
_CHUNK_DOCS = 16


def sample_indices(docs: Documents, sample_bytes: int) -> np.ndarray:
    """Documents in calibration order until their bytes reach ``sample_bytes``."""
    order = calibration_order(len(docs))
    cumulative = np.cumsum(docs.nbytes[order])
    count = int(np.searchsorted(cumulative, sample_bytes, side="left")) + 1
    return order[: min(count, len(order))]


def tokens_per_byte(docs: Documents, tokenizer: LoadedTokenizer, pool: TokenizerPool, sample_bytes: int) -> float:
    """Tokens (without EOS) per UTF-8 byte over the calibration sample; memoised per process."""
    key = (docs.sha256, tokenizer.sha256, sample_bytes)
    with _memo_lock:
        if key in _memo:
            return _memo[key]
    picked = sample_indices(docs, sample_bytes)
    texts = [docs.texts[i] for i in picked]
    futures = [pool.submit(tokenizer.encode, texts[i : i + _CHUNK_DOCS]) for i in range(0, len(texts), _CHUNK_DOCS)]
    tokens = sum(int(f.result()[1].sum()) - len(f.result()[1]) for f in futures)
    total_bytes = int(docs.nbytes[picked].sum())
    value = tokens / total_bytes if total_bytes else 1.0
    with _memo_lock:
        _memo[key] = value
    return value
