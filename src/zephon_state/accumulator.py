"""The accumulator: a lane's tokenized documents of one source, back in input order.

The document sequence is fixed up front (dealing needs no token counts), so chunks of it are
handed to the worker pool ahead of need. Results are taken in submission order, whatever
order the workers finish in, which makes the output independent of the number of workers.
"""
from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from .deal import SourceReader
from .tokenize import LoadedTokenizer, TokenizerPool

_MAX_CHUNK_DOCS = 256


@dataclass(frozen=True)
class TokenizedDocument:
    """A document's token ids (int32, ending with EOS) and where it sits in the lane's share
    of its source (what a cursor records to come back to it)."""

    tokens: np.ndarray
    epoch: int
    index: int


class Accumulator:
    """Submits chunks of documents to the pool, ``readahead_bytes`` ahead, and hands out the
    tokenized documents in order."""

    def __init__(
        self,
        reader: SourceReader,
        tokenizer: LoadedTokenizer,
        pool: TokenizerPool,
        chunk_bytes: int,
        readahead_bytes: int,
    ) -> None:
        self.reader, self.tokenizer, self.pool = reader, tokenizer, pool
        self.chunk_bytes, self.readahead_bytes = chunk_bytes, 0
        self._readahead_bytes = readahead_bytes  # held back until start_readahead()
        docs = reader.plan.documents[reader.source]
        self._texts, self._nbytes = docs.texts, docs.nbytes
        self._pending: deque[tuple[Future, list[tuple[int, int]], int]] = deque()
        self._ready: deque[TokenizedDocument] = deque()
        self._ahead = 0

    def _submit_chunk(self) -> None:
        where: list[tuple[int, int]] = []
        texts: list[str] = []
        nbytes = 0
        while nbytes < self.chunk_bytes and len(texts) < _MAX_CHUNK_DOCS:
            epoch, index, doc = self.reader.next()
            where.append((epoch, index))
            texts.append(self._texts[doc])
            nbytes += max(1, int(self._nbytes[doc]))  # an empty document still moves readahead on
        self._pending.append((self.pool.submit(self.tokenizer.encode, texts), where, nbytes))
        self._ahead += nbytes

    def start_readahead(self) -> None:
        """Tokenize ``readahead_bytes`` ahead from now on, starting at once. A lane calls it
        once its first window is built: before that, the single queue of the pool would
        tokenize this lane's next window ahead of the other lanes' first ones (on a restore
        that doubles the text tokenized before the first batch)."""
        self.readahead_bytes = self._readahead_bytes
        self.top_up()

    def top_up(self) -> None:
        """Keep at least ``readahead_bytes`` of text (and one chunk) submitted and not yet
        handed out; nothing ahead before :meth:`start_readahead`."""
        while self.readahead_bytes and (self._ahead < self.readahead_bytes or not self._pending):
            self._submit_chunk()

    def next_document(self) -> TokenizedDocument:
        if not self._ready:
            if not self._pending:
                self._submit_chunk()
            future, where, nbytes = self._pending.popleft()
            self._ahead -= nbytes
            self.top_up()
            flat, lengths = future.result()
            start = 0
            for (epoch, index), end in zip(where, np.cumsum(lengths).tolist()):
                self._ready.append(TokenizedDocument(flat[start:end], epoch, index))
                start = end
        return self._ready.popleft()

    def cancel(self) -> None:
        """Cancel the tokenization still queued (when the lane's run stops); safe to call from
        another thread than the one reading."""
        while True:
            try:
                pending = list(self._pending)
                break
            except RuntimeError:  # the reading thread changed the deque meanwhile
                continue
        for future, _, _ in pending:
            future.cancel()
