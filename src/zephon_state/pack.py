"""Packing: documents (each ending in EOS) into rows of exactly ``max_length`` tokens.

Both packers emit, per token: the label (the document's next token; ``IGNORE`` after a
document's last token and on padding), the position within the document's segment in the
row (restarting at 0 at each row start and at each document start) and the segment's
index within the row (``PAD_DOCUMENT`` on padding), which is what a block-causal mask needs.

- ``wrap`` concatenates documents and cuts every ``max_length`` tokens; the remainder of a
  document carries into the next row (the label at a cut is the document's next token).
- ``best_fit`` keeps documents whole: within one window it places documents, largest first,
  into the fullest row that still has room, and pads; a document longer than ``max_length``
  is cut into ``max_length`` pieces first. All rows close at the window end.

Both take ``Piece``s (``stream.py``): runs of one document's tokens with their labels.

Everything per token is NumPy; Python only loops per document or per piece.
"""
from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .stream import IGNORE, Piece

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
    def empty(cls, max_length: int) -> "Rows":
        z = np.zeros((0, max_length), dtype=np.int32)
        return cls(z, z, z, z, z.astype(np.int16))

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


def _join(pieces: Sequence[Piece]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Tokens and labels of the pieces back to back, each piece's length and source."""
    tokens = np.concatenate([p.tokens for p in pieces])
    lengths = np.fromiter((len(p) for p in pieces), np.int64, len(pieces))
    labels = np.empty_like(tokens)
    labels[:-1] = tokens[1:]
    labels[np.cumsum(lengths) - 1] = np.fromiter((p.next for p in pieces), np.int32, len(pieces))
    sources = np.fromiter((p.source for p in pieces), np.int64, len(pieces))
    return tokens, labels, lengths, sources


def pack_wrap(pieces: Sequence[Piece], max_length: int) -> Rows:
    """Concatenate the pieces (a multiple of ``max_length`` tokens in all) and cut rows.

    Per-token ids come from segments (runs of one piece within one row) by ``np.repeat``."""
    tokens, labels, lengths, sources = _join(pieces)
    total = len(tokens)
    piece_starts = np.cumsum(lengths) - lengths
    row_starts = np.arange(0, total, max_length)
    seg_starts = np.union1d(piece_starts, row_starts)
    seg_lengths = np.diff(np.append(seg_starts, total))
    seg_piece = np.searchsorted(piece_starts, seg_starts, side="right") - 1
    first_in_row = np.searchsorted(seg_starts, row_starts)
    seg_in_row = np.arange(len(seg_starts)) - first_in_row[seg_starts // max_length]
    shape = (total // max_length, max_length)
    positions = np.arange(total, dtype=np.int32) - np.repeat(seg_starts.astype(np.int32), seg_lengths)
    documents = np.repeat(seg_in_row.astype(np.int32), seg_lengths)
    source_ids = np.repeat(sources[seg_piece].astype(np.int16), seg_lengths)
    return Rows(tokens.reshape(shape), labels.reshape(shape), positions.reshape(shape),
                documents.reshape(shape), source_ids.reshape(shape))


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


def pack_best_fit(pieces: Sequence[Piece], max_length: int, pad_id: int) -> Rows:
    """Place whole pieces (each at most ``max_length`` tokens) into rows by best fit; pad."""
    tokens, labels, lengths, sources = _join(pieces)
    bin_of, offset_of, bins = best_fit_bins(lengths.tolist(), max_length)
    piece_start = np.cumsum(lengths) - lengths
    base = np.asarray(bin_of, dtype=np.int64) * max_length + np.asarray(offset_of, dtype=np.int64) - piece_start
    dest = np.repeat(base, lengths) + np.arange(len(tokens))
    size = bins * max_length
    row_tokens = np.full(size, pad_id, dtype=np.int32)
    row_labels = np.full(size, IGNORE, dtype=np.int32)
    seg = np.full(size, -1, dtype=np.int64)
    row_tokens[dest] = tokens
    row_labels[dest] = labels
    seg[dest] = np.repeat(np.arange(len(pieces)), lengths)
    shape = (bins, max_length)
    return _finish(row_tokens.reshape(shape), row_labels.reshape(shape), seg.reshape(shape), sources)
