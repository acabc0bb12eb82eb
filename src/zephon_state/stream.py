"""A lane's stream of one source: tokenized documents, cut into pieces on demand.

A piece is a run of one document's tokens; each token's label is the next token of the same
document, and ``IGNORE`` after the document's last token (its EOS). A piece that stops inside
its document carries that document's next token (``next``) as the label of its last token,
even though that token lands in another row or window.

The accumulator may hand a long document out in parts; a piece never stops at a part's end
for that reason (pieces and their labels are those of whole documents), and the stream's
state names the current part's start as the resume point.
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
    """Starts at ``state`` (document, offset into it, tokens emitted so far, resume point:
    the accumulator's first part starts at token ``state.base`` of the document)."""

    def __init__(self, source: int, acc: Accumulator, state: SourceState, lane: int) -> None:
        self.source, self.acc = source, acc
        self.tokens = state.tokens
        self._doc: TokenizedDocument = acc.next_document()
        skip = state.offset - state.base
        while skip >= len(self._doc.tokens):
            if self._doc.last:
                raise StateError(
                    f"cursor of lane {lane} starts {state.offset} tokens into a document of source {source} that "
                    f"has {self._doc.base + len(self._doc.tokens)} tokens; the data or tokenizer differs from the "
                    "checkpoint's"
                )
            skip -= len(self._doc.tokens)
            self._doc = acc.next_document()
        self._offset = skip  # into the current part

    def state(self) -> SourceState:
        d = self._doc
        return SourceState(d.epoch, d.index, d.base + self._offset, self.tokens, d.char, d.base)

    def _cut(self, n: int) -> Piece:
        """Up to ``n`` tokens of the current document (fewer where it ends), across its parts."""
        runs = []
        got = 0
        while True:
            part, start = self._doc, self._offset
            stop = min(len(part.tokens), start + n - got)
            runs.append(part.tokens[start:stop])
            got += stop - start
            if stop < len(part.tokens):
                self._offset, label = stop, int(part.tokens[stop])
                break
            self._doc, self._offset = self.acc.next_document(), 0
            if part.last or got == n:
                label = IGNORE if part.last else int(self._doc.tokens[0])
                break
        self.tokens += got
        return Piece(runs[0] if len(runs) == 1 else np.concatenate(runs), label, self.source)

    def take_exactly(self, n: int) -> list[Piece]:
        """Pieces holding exactly ``n`` tokens, cutting documents where needed (``wrap``)."""
        out = []
        while n > 0:
            piece = self._cut(n)
            out.append(piece)
            n -= len(piece)
        return out

    def take_pieces(self, n: int, max_length: int) -> list[Piece]:
        """Pieces of at most ``max_length`` tokens, cut only at multiples of ``max_length``
        within a document, until they hold at least ``n`` tokens (``best_fit``)."""
        out = []
        got = 0
        while got < n:
            piece = self._cut(max_length - (self._doc.base + self._offset) % max_length)
            out.append(piece)
            got += len(piece)
        return out
