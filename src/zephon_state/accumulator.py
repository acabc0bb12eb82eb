"""The accumulator: a lane's tokenized documents, back in input order.

The lane's reader decides the document sequence up front (it needs no token counts), so
chunks of it are handed to the worker pool ahead of need. Results are taken in submission
order, whatever order the workers finish in, which makes the output independent of the
number of workers.
"""
from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from .cursor import SourceState
from .mix import LaneReader, Pick
from .tokenize import LoadedTokenizer, TokenizerPool

_MAX_CHUNK_DOCS = 256


@dataclass(frozen=True)
class TokenizedDocument:
    """A document's token ids (int32, ending with EOS), its source, and the mixer state before
    it was chosen (what a cursor records to come back to it)."""

    tokens: np.ndarray
    source: int
    before: tuple[SourceState, ...]


class Accumulator:
    """Submits chunks of a lane's documents to the pool, ``readahead_bytes`` ahead, and hands
    out the tokenized documents in order."""

    def __init__(
        self,
        reader: LaneReader,
        tokenizer: LoadedTokenizer,
        pool: TokenizerPool,
        chunk_bytes: int,
        readahead_bytes: int,
    ) -> None:
        self.reader, self.tokenizer, self.pool = reader, tokenizer, pool
        self.chunk_bytes, self.readahead_bytes = chunk_bytes, readahead_bytes
        self._pending: deque[tuple[Future, list[Pick], int]] = deque()
        self._ready: deque[TokenizedDocument] = deque()
        self._ahead = 0

    def _submit_chunk(self) -> None:
        plan = self.reader.plan
        picks: list[Pick] = []
        nbytes = 0
        while nbytes < self.chunk_bytes and len(picks) < _MAX_CHUNK_DOCS:
            pick = self.reader.next()
            picks.append(pick)
            nbytes += int(plan.documents[pick.source].nbytes[pick.index])
        texts = [plan.text(p.source, p.index) for p in picks]
        self._pending.append((self.pool.submit(self.tokenizer.encode, texts), picks, nbytes))
        self._ahead += nbytes

    def top_up(self) -> None:
        """Keep at least ``readahead_bytes`` of text submitted and not yet handed out."""
        while self._ahead < self.readahead_bytes or not self._pending:
            self._submit_chunk()

    def next_document(self) -> TokenizedDocument:
        if not self._ready:
            self.top_up()
            future, picks, nbytes = self._pending.popleft()
            self._ahead -= nbytes
            self.top_up()
            flat, lengths = future.result()
            ends = np.cumsum(lengths).tolist()
            start = 0
            for pick, end in zip(picks, ends):
                self._ready.append(TokenizedDocument(flat[start:end], pick.source, pick.before))
                start = end
        return self._ready.popleft()

    def cancel(self) -> None:
        """Cancel the tokenization still queued for this lane (when its run stops)."""
        for future, _, _ in list(self._pending):
            future.cancel()
