"""A lane's stream of one source: tokenized documents, cut into pieces on demand.

A piece is a run of one document's tokens; each token's label is the next token of the same
document, and ``IGNORE`` after the document's last token (its EOS). A piece that stops inside
its document carries that document's next token (``next``) as the label of its last token,
even though that token lands in another row or window.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .accumulator import Accumulator, TokenizedDocument
from .cursor import SourceState
from .errors import StateError

IGNORE = -100


@dataclass(frozen=True, eq=False)
class Piece:
    tokens: np.ndarray
    next: int  # label of the last token: the document's next token, or IGNORE
    source: int

    def __len__(self) -> int:
        return len(self.tokens)


class SourceStream:
    """Starts at ``state`` (document, offset into it, tokens emitted so far)."""

    def __init__(self, source: int, acc: Accumulator, state: SourceState, lane: int) -> None:
        self.source, self.acc = source, acc
        self.tokens = state.tokens
        self._doc: TokenizedDocument = acc.next_document()
        if state.offset >= len(self._doc.tokens):
            raise StateError(
                f"cursor of lane {lane} starts {state.offset} tokens into a document of source {source} that "
                f"has {len(self._doc.tokens)} tokens; the data or tokenizer differs from the checkpoint's"
            )
        self._offset = state.offset

    def state(self) -> SourceState:
        return SourceState(self._doc.epoch, self._doc.index, self._offset, self.tokens)

    def _cut(self, n: int) -> Piece:
        doc, start = self._doc.tokens, self._offset
        stop = start + n
        self.tokens += n
        if stop == len(doc):
            self._doc, self._offset = self.acc.next_document(), 0
            return Piece(doc[start:stop], IGNORE, self.source)
        self._offset = stop
        return Piece(doc[start:stop], int(doc[stop]), self.source)

    def take_exactly(self, n: int) -> list[Piece]:
        """Pieces holding exactly ``n`` tokens, cutting documents where needed (``wrap``)."""
        out = []
        while n > 0:
            piece = self._cut(min(n, len(self._doc.tokens) - self._offset))
            out.append(piece)
            n -= len(piece)
        return out

    def take_pieces(self, n: int, max_length: int) -> list[Piece]:
        """Pieces of at most ``max_length`` tokens, cut only at multiples of ``max_length``
        within a document, until they hold at least ``n`` tokens (``best_fit``)."""
        out = []
        got = 0
        while got < n:
            room = len(self._doc.tokens) - self._offset
            piece = self._cut(min(room, max_length - self._offset % max_length))
            out.append(piece)
            got += len(piece)
        return out
