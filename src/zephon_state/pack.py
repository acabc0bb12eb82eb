"""Packing: documents (each ending in EOS) into rows of exactly ``max_length`` tokens.

Both packers emit, per token: the label (the document's next token; ``IGNORE`` after a
document's last token and on padding), the position within the document's segment in the
row (restarting at 0 at each row start and at each document start) and the segment's
index within the row (``PAD_DOCUMENT`` on padding), which is what a block-causal mask needs.

- ``wrap`` concatenates documents and cuts every ``max_length`` tokens; the remainder of a
  document carries into the next row (its label at a cut is the next row's first token).
- ``best_fit`` keeps documents whole: within one window it places documents, largest first,
  into the fullest row that still has room, and pads; a document longer than ``max_length``
  is cut into ``max_length`` pieces first. All rows close at the window end.

Everything per token is NumPy; Python only loops per document or per piece.
"""
from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass
from typing import Sequence

import numpy as np

IGNORE = -100
PAD_DOCUMENT = -1
PAD_SOURCE = -1
ALGORITHMS = ("wrap", "best_fit")


@dataclass(frozen=True, eq=False)
class Rows:
    """Packed rows, all ``[rows, max_length]``: ``input_ids``, ``labels``, ``position_ids``,
    ``document_ids`` (int32) and ``source_ids`` (int16, index of the source in the plan)."""

    input_ids: np.ndarray
    labels: np.ndarray
    position_ids: np.ndarray
    document_ids: np.ndarray
    source_ids: np.ndarray

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def take(self, index: np.ndarray | slice) -> "Rows":
        return Rows(*(a[index] for a in self._arrays()))

    def _arrays(self) -> tuple[np.ndarray, ...]:
        return (self.input_ids, self.labels, self.position_ids, self.document_ids, self.source_ids)

    @classmethod
    def concat(cls, parts: Sequence["Rows"]) -> "Rows":
        if len(parts) == 1:
            return parts[0]
        return cls(*(np.concatenate(arrays) for arrays in zip(*(p._arrays() for p in parts))))


def _finish(tokens: np.ndarray, labels: np.ndarray, seg: np.ndarray, seg_source: np.ndarray) -> Rows:
    """Derive position and document ids from ``seg`` (a segment id per token, -1 on padding)."""
    rows, width = tokens.shape
    starts = np.empty((rows, width), dtype=bool)
    starts[:, 0] = True
    np.not_equal(seg[:, 1:], seg[:, :-1], out=starts[:, 1:])
    cols = np.arange(width, dtype=np.int32)
    positions = cols - np.maximum.accumulate(np.where(starts, cols, np.int32(0)), axis=1)
    documents = np.cumsum(starts, axis=1, dtype=np.int32) - 1
    sources = seg_source[np.maximum(seg, 0)].astype(np.int16)
    pad = seg < 0
    if pad.any():
        positions[pad] = 0
        documents[pad] = PAD_DOCUMENT
        sources[pad] = PAD_SOURCE
    return Rows(np.ascontiguousarray(tokens, dtype=np.int32), labels.astype(np.int32, copy=False),
                positions.astype(np.int32, copy=False), documents, sources)


def pack_wrap(stream: np.ndarray, seg: np.ndarray, seg_source: np.ndarray, max_length: int) -> Rows:
    """Cut ``stream`` (``n * max_length + 1`` tokens: the last one only decides the last label)
    into ``n`` rows. ``seg`` gives each token's document (an index into ``seg_source``)."""
    n = (len(stream) - 1) // max_length
    cut = n * max_length
    tokens = stream[:cut].reshape(n, max_length)
    same = (seg[1 : cut + 1] == seg[:cut]).reshape(n, max_length)
    labels = np.where(same, stream[1 : cut + 1].reshape(n, max_length), np.int32(IGNORE))
    return _finish(tokens, labels, seg[:cut].reshape(n, max_length), seg_source)


def _pieces(lengths: np.ndarray, max_length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cut each document into ``max_length`` pieces: (piece's document, start in the flat
    stream, length), in stream order."""
    per_doc = (lengths + max_length - 1) // max_length
    doc = np.repeat(np.arange(len(lengths)), per_doc)
    first = np.cumsum(per_doc) - per_doc
    k = np.arange(len(doc)) - np.repeat(first, per_doc)
    doc_start = np.cumsum(lengths) - lengths
    start = doc_start[doc] + k * max_length
    length = np.minimum(max_length, lengths[doc] - k * max_length)
    return doc, start, length


def best_fit_bins(sizes: Sequence[int], capacity: int) -> tuple[list[int], list[int], int]:
    """Best-fit decreasing: each item (largest first, ties in input order) goes to the bin
    with the least room that still fits it, else to a new bin. Returns each item's bin and
    offset within it, and the number of bins."""
    bin_of = [0] * len(sizes)
    offset_of = [0] * len(sizes)
    room: list[tuple[int, int]] = []  # (free tokens, bin), sorted
    bins = 0
    for item in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        size = sizes[item]
        at = bisect_left(room, (size, -1))
        if at == len(room):
            b, free = bins, capacity
            bins += 1
        else:
            free, b = room.pop(at)
        bin_of[item], offset_of[item] = b, capacity - free
        if free - size > 0:
            insort(room, (free - size, b))
    return bin_of, offset_of, bins


def pack_best_fit(flat: np.ndarray, lengths: np.ndarray, doc_source: np.ndarray, max_length: int, pad_id: int) -> Rows:
    """Pack whole documents (``flat`` holds them back to back, ``lengths`` each one's size)."""
    total = len(flat)
    doc_of_token = np.repeat(np.arange(len(lengths)), lengths)
    labels_flat = np.full(total, IGNORE, dtype=np.int32)
    labels_flat[:-1] = np.where(doc_of_token[1:] == doc_of_token[:-1], flat[1:], np.int32(IGNORE))
    piece_doc, piece_start, piece_len = _pieces(lengths, max_length)
    bin_of, offset_of, bins = best_fit_bins(piece_len.tolist(), max_length)
    base = np.asarray(bin_of, dtype=np.int64) * max_length + np.asarray(offset_of, dtype=np.int64) - piece_start
    dest = np.repeat(base, piece_len) + np.arange(total)
    tokens = np.full(bins * max_length, pad_id, dtype=np.int32)
    labels = np.full(bins * max_length, IGNORE, dtype=np.int32)
    seg = np.full(bins * max_length, -1, dtype=np.int64)
    tokens[dest] = flat
    labels[dest] = labels_flat
    seg[dest] = np.repeat(np.arange(len(piece_len)), piece_len)
    shape = (bins, max_length)
    return _finish(tokens.reshape(shape), labels.reshape(shape), seg.reshape(shape), doc_source[piece_doc])
