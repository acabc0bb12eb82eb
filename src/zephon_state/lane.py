"""A lane: one fixed logical stream of packed, shuffled rows.

What a lane emits is a function of (data, plan, tokenizer, seed, lane id, lane count) only:
not of the rank that hosts it, the number of ranks, or the number of tokenizer workers.
It works window by window: take each source's token quota for the window from that source's
stream, pack the pieces into rows, order the rows by the (seed, lane, window) permutation,
hand them out. At each window start its pack and shuffle buffers are empty, which is why a
cursor needs no buffer contents.
"""
from __future__ import annotations

from dataclasses import dataclass

from .accumulator import Accumulator
from .cursor import LaneCursor, SourceState, cursor_error
from .deal import SourceReader
from .errors import StateError
from .mix import allotment
from .pack import Rows, pack_best_fit, pack_wrap
from .mixture import Plan
from .shuffle import window_order
from .stream import Piece, SourceStream
from .tokenize import LoadedTokenizer, TokenizerPool

_MIN_CHUNK_BYTES = 4096
_MIN_PART_CHARS = 1024


@dataclass(frozen=True, eq=False)
class LaneSetup:
    """What every lane of a run shares."""

    plan: Plan
    tokenizer: LoadedTokenizer
    pool: TokenizerPool
    lanes: int
    max_length: int
    algorithm: str
    window: int  # rows per window: the shuffle buffer size, or the packing window
    shuffle: bool
    chunk_bytes: tuple[int, ...]  # text per tokenizer call, per source
    readahead_bytes: tuple[int, ...]  # text tokenized ahead, per source
    part_chars: tuple[int, ...]  # documents are tokenized in parts of about this many characters (resume points)

    @property
    def window_tokens(self) -> int:
        return self.window * self.max_length

    @classmethod
    def build(
        cls, plan: Plan, tokenizer: LoadedTokenizer, pool: TokenizerPool, lanes: int, max_length: int,
        algorithm: str, window: int, shuffle: bool, chunk_bytes: int, readahead_windows: float,
    ) -> "LaneSetup":
        """Size each source's tokenizer calls and readahead from its share of a window's
        tokens and its tokens per byte (the calibration). A long document is tokenized in parts
        of a quarter chunk (at least 1,024 characters), where the tokenizer allows: a restore
        then re-tokenizes less than a part before its window."""
        window_bytes = [window * max_length * share / tpb for share, tpb in zip(plan.shares, plan.tokens_per_byte)]
        chunks = tuple(int(min(chunk_bytes, max(_MIN_CHUNK_BYTES, b / 4))) for b in window_bytes)
        ahead = tuple(int(b * readahead_windows) + c for b, c in zip(window_bytes, chunks))
        parts = tuple(max(_MIN_PART_CHARS, c // 4) for c in chunks)
        return cls(plan, tokenizer, pool, lanes, max_length, algorithm, window, shuffle, chunks, ahead, parts)

    def check_cursor(self, cursor: LaneCursor, lane: int) -> None:
        """Refuse a cursor this plan cannot have written, naming the field: a document past the
        lane's share, fewer tokens than the documents read, token counts off the window's
        quotas, rows beyond the window. (Reading then starts at most one window from where
        the cursor says, so an absurd cursor cannot make a lane read without end.)"""
        targets = allotment(cursor.window * self.window_tokens, self.plan.shares)
        for i, (s, docs, target) in enumerate(zip(cursor.sources, self.plan.documents, targets)):
            share = len(range(lane, len(docs), self.lanes))
            if s.index >= share:
                raise cursor_error(lane, f"'sources[{i}].index' is {s.index}, but the lane's share of the source "
                                         f"has {share} documents")
            least = s.epoch * share + s.index + s.offset  # every document holds at least its EOS token
            if s.tokens < least:
                raise cursor_error(lane, f"'sources[{i}].tokens' is {s.tokens}, but its epoch {s.epoch}, index "
                                         f"{s.index} and offset {s.offset} mean at least {least} tokens were read")
            if s.char and not self.tokenizer.cuts:
                raise cursor_error(lane, f"'sources[{i}].char' is {s.char}, but tokenizer {self.tokenizer.id!r} "
                                         "is only read from document starts (char 0)")
            exact = self.algorithm == "wrap"
            if not (s.tokens == target if exact else target <= s.tokens < target + self.max_length):
                want = f"{target}" if exact else f"in [{target}, {target + self.max_length})"
                raise cursor_error(lane, f"'sources[{i}].tokens' is {s.tokens}, but at the start of window "
                                         f"{cursor.window} the source's quota makes it {want}")
            if not exact and s.offset % self.max_length:
                raise cursor_error(lane, f"'sources[{i}].offset' is {s.offset}, not a multiple of max_length "
                                         f"{self.max_length} (best_fit cuts documents only there)")
        if self.algorithm == "wrap":
            if cursor.emitted >= self.window:
                raise cursor_error(lane, f"'emitted' is {cursor.emitted}, but a window has {self.window} rows")
            if cursor.sequences != cursor.window * self.window + cursor.emitted:
                raise cursor_error(lane, f"'sequences' is {cursor.sequences}, but window {cursor.window} and "
                                         f"emitted {cursor.emitted} make it {cursor.window * self.window + cursor.emitted}")
        elif cursor.sequences < cursor.emitted:
            raise cursor_error(lane, f"'sequences' is {cursor.sequences}, fewer than 'emitted' {cursor.emitted}")


class Lane:
    """Emits rows from ``cursor`` on; ``take`` also returns the cursor after each row."""

    def __init__(self, lane_id: int, setup: LaneSetup, cursor: LaneCursor) -> None:
        self.id, self.setup = lane_id, setup
        self.streams: list[SourceStream] = []
        for source, state in enumerate(cursor.sources):
            self.streams.append(self._stream(source, state))
        self.window_index = cursor.window
        self.sequences = cursor.sequences
        self._build()
        if cursor.emitted and cursor.emitted >= len(self._rows):
            raise StateError(
                f"cursor of lane {lane_id} says {cursor.emitted} rows of window {cursor.window} were "
                f"emitted, but that window has {len(self._rows)} rows; the data differs from the checkpoint's"
            )
        self._pos = cursor.emitted

    def _stream(self, source: int, state: SourceState) -> SourceStream:
        s = self.setup
        try:
            reader = SourceReader(s.plan, source, self.id, s.lanes, state.epoch, state.index)
        except ValueError as e:
            raise StateError(f"cursor of lane {self.id} points past the end of its share: {e}") from None
        acc = Accumulator(reader, s.tokenizer, s.pool, s.chunk_bytes[source], s.readahead_bytes[source],
                          s.part_chars[source], state.char, state.base)
        return SourceStream(source, acc, state, self.id)

    def _pieces(self) -> list[Piece]:
        s = self.setup
        targets = allotment((self.window_index + 1) * s.window_tokens, s.plan.shares)
        pieces: list[Piece] = []
        for stream, target in zip(self.streams, targets):
            quota = target - stream.tokens
            if quota <= 0:
                continue
            if s.algorithm == "wrap":
                pieces.extend(stream.take_exactly(quota))
            else:
                pieces.extend(stream.take_pieces(quota, s.max_length))
        return pieces

    def _build(self) -> None:
        s = self.setup
        self._start = tuple(stream.state() for stream in self.streams)
        pieces = self._pieces()
        if not pieces:
            self._rows = Rows.empty(s.max_length)
        elif s.algorithm == "wrap":
            self._rows = pack_wrap(pieces, s.max_length)
        else:
            self._rows = pack_best_fit(pieces, s.max_length, s.tokenizer.eos_id)
        self._end = tuple(stream.state() for stream in self.streams)
        n = len(self._rows)
        plan = s.plan
        self._order = window_order(plan.seed, plan.phase, self.id, self.window_index, n) if s.shuffle else None
        self._pos = 0

    def take(self, k: int) -> tuple[Rows, list[LaneCursor]]:
        """The next ``k`` rows and, for each, the lane's cursor once it has been consumed."""
        parts: list[Rows] = []
        cursors: list[LaneCursor] = []
        while k > 0:
            while self._pos == len(self._rows):
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

    def start_readahead(self) -> None:
        for stream in self.streams:
            stream.acc.start_readahead()

    def cancel(self) -> None:
        for stream in self.streams:
            stream.acc.cancel()
