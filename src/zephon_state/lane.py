"""A lane: one fixed logical stream of packed, shuffled rows.

What a lane emits is a function of (data, plan, tokenizer, seed, lane id, lane count) only:
not of the rank that hosts it, the number of ranks, or the number of tokenizer workers.
It works window by window: read the window's tokens from the accumulator, pack them, shuffle
the rows with the (seed, lane, window) order, hand them out. At each window start its pack
and shuffle buffers are empty, which is why a cursor needs no buffer contents.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .accumulator import Accumulator, TokenizedDocument
from .cursor import InputPosition, LaneCursor
from .errors import StateError
from .mix import LaneReader
from .pack import Rows, pack_best_fit, pack_wrap
from .plan import Plan
from .shuffle import window_order
from .tokenize import LoadedTokenizer, TokenizerPool


@dataclass(frozen=True, eq=False)
class LaneSetup:
    """What every lane of a run shares."""

    plan: Plan
    tokenizer: LoadedTokenizer
    pool: TokenizerPool
    lanes: int
    max_length: int
    algorithm: str
    window: int  # rows per window (wrap), or rows' worth of tokens per window (best_fit)
    shuffle: bool
    chunk_bytes: int
    readahead_bytes: int


class Lane:
    """Emits rows from ``cursor`` on; ``take`` also returns the cursor after each row."""

    def __init__(self, lane_id: int, setup: LaneSetup, cursor: LaneCursor) -> None:
        self.id, self.setup = lane_id, setup
        reader = LaneReader(setup.plan, lane_id, setup.lanes, cursor.input.sources)
        self.acc = Accumulator(reader, setup.tokenizer, setup.pool, setup.chunk_bytes, setup.readahead_bytes)
        self.window_index = cursor.window
        self.sequences = cursor.sequences
        self._current: tuple[TokenizedDocument, int] | None = None
        if cursor.input.offset:
            self._restore_offset(cursor.input.offset)
        self._build()
        if cursor.emitted >= len(self._rows):
            raise StateError(
                f"cursor of lane {lane_id} says {cursor.emitted} rows of window {cursor.window} were "
                f"emitted, but that window has {len(self._rows)} rows; the data differs from the checkpoint's"
            )
        self._pos = cursor.emitted

    def _restore_offset(self, offset: int) -> None:
        if self.setup.algorithm != "wrap":
            raise StateError(
                f"cursor of lane {self.id} starts {offset} tokens into a document, which only 'wrap' "
                f"packing does; this pipeline packs with {self.setup.algorithm!r}"
            )
        doc = self.acc.next_document()
        if offset >= len(doc.tokens):
            raise StateError(
                f"cursor of lane {self.id} starts {offset} tokens into a document of {len(doc.tokens)} "
                "tokens; the data or tokenizer differs from the checkpoint's"
            )
        self._current = (doc, offset)

    def _peek(self) -> tuple[TokenizedDocument, int]:
        if self._current is None:
            self._current = (self.acc.next_document(), 0)
        return self._current

    def _position(self) -> InputPosition:
        doc, offset = self._peek()
        return InputPosition(doc.before, offset)

    def _gather_wrap(self) -> Rows:
        need = self.setup.window * self.setup.max_length
        pieces, seg_lengths, sources = [], [], []
        got = 0
        while got < need:
            doc, offset = self._peek()
            n = min(len(doc.tokens) - offset, need - got)
            pieces.append(doc.tokens[offset : offset + n])
            seg_lengths.append(n)
            sources.append(doc.source)
            got += n
            self._current = None if offset + n == len(doc.tokens) else (doc, offset + n)
        doc, offset = self._peek()  # one token past the window decides the last label
        pieces.append(doc.tokens[offset : offset + 1])
        if offset > 0:
            seg_lengths[-1] += 1
        else:
            seg_lengths.append(1)
            sources.append(doc.source)
        stream = np.concatenate(pieces)
        seg = np.repeat(np.arange(len(seg_lengths)), seg_lengths)
        return pack_wrap(stream, seg, np.asarray(sources, dtype=np.int64), self.setup.max_length)

    def _gather_best_fit(self) -> Rows:
        need = self.setup.window * self.setup.max_length
        docs: list[TokenizedDocument] = []
        got = 0
        while got < need:
            doc, _ = self._peek()
            docs.append(doc)
            got += len(doc.tokens)
            self._current = None
        flat = np.concatenate([d.tokens for d in docs])
        lengths = np.fromiter((len(d.tokens) for d in docs), np.int64, len(docs))
        sources = np.fromiter((d.source for d in docs), np.int64, len(docs))
        return pack_best_fit(flat, lengths, sources, self.setup.max_length, self.setup.tokenizer.eos_id)

    def _build(self) -> None:
        self._start = self._position()
        self._rows = self._gather_wrap() if self.setup.algorithm == "wrap" else self._gather_best_fit()
        self._end = self._position()
        plan = self.setup.plan
        n = len(self._rows)
        self._order = window_order(plan.seed, plan.phase, self.id, self.window_index, n) if self.setup.shuffle else None
        self._pos = 0

    def take(self, k: int) -> tuple[Rows, list[LaneCursor]]:
        """The next ``k`` rows and, for each, the lane's cursor once it has been consumed."""
        parts: list[Rows] = []
        cursors: list[LaneCursor] = []
        while k > 0:
            if self._pos == len(self._rows):
                self.window_index += 1
                self._build()
            n = min(k, len(self._rows) - self._pos)
            stop = self._pos + n
            index = self._order[self._pos : stop] if self._order is not None else slice(self._pos, stop)
            parts.append(self._rows.take(index))
            total = len(self._rows)
            for j in range(self._pos + 1, stop + 1):
                self.sequences += 1
                if j == total:
                    cursors.append(LaneCursor(self._end, self.window_index + 1, 0, self.sequences))
                else:
                    cursors.append(LaneCursor(self._start, self.window_index, j, self.sequences))
            self._pos = stop
            k -= n
        return Rows.concat(parts), cursors
