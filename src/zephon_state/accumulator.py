"""The accumulator: a lane's tokenized documents of one source, back in input order.

The document sequence is fixed up front (dealing needs no token counts), so chunks of it are
handed to the worker pool ahead of need. Results are taken in submission order, whatever
order the workers finish in, which makes the output independent of the number of workers.

With a tokenizer that allows it (``LoadedTokenizer.cuts``), a document longer than
``part_chars`` is tokenized in parts cut at ``next_cut``: the parts' tokens are the whole
document's, and a part's start is a point a cursor can resume from (``char``, ``base``).
"""
from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from .deal import SourceReader
from .errors import StateError
from .tokenize import LoadedTokenizer, TokenizerPool, next_cut

_MAX_CHUNK_DOCS = 256


@dataclass(frozen=True)
class TokenizedDocument:
    """A part of a document: its token ids (int32; the last part ends with EOS), where the
    document sits in the lane's share of its source, and where the part starts in it (the
    character ``char`` of its text, the token ``base``): what a cursor records to come back."""

    tokens: np.ndarray
    epoch: int
    index: int
    char: int = 0
    base: int = 0
    last: bool = True  # the document's last part


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
        part_chars: int | None = None,
        char: int = 0,
        base: int = 0,
    ) -> None:
        """``part_chars``: cut documents into parts of at least that many characters (None:
        never). ``char``, ``base``: the first document is read from its character ``char``,
        which starts its token ``base`` (a cursor's resume point)."""
        self.reader, self.tokenizer, self.pool = reader, tokenizer, pool
        self.chunk_bytes, self.readahead_bytes = chunk_bytes, 0
        self._readahead_bytes = readahead_bytes  # held back until start_readahead()
        self.part_chars = part_chars if tokenizer.cuts else None
        docs = reader.plan.documents[reader.source]
        self._texts, self._nbytes = docs.texts, docs.nbytes
        self._pending: deque[tuple[Future, list[tuple[int, int, int, bool]], int]] = deque()
        self._ready: deque[TokenizedDocument] = deque()
        self._ahead = 0
        self._doc: tuple[int, int, int] | None = None  # (epoch, index, document) being cut into parts
        self._char, self._first_char, self._base = 0, char, base

    def _next_part(self) -> tuple[tuple[int, int, int, bool], str, int]:
        """(epoch, index, char, last), the text and its share of the document's bytes."""
        if self._doc is None:
            self._doc, self._char = self.reader.next(), self._first_char
            self._first_char = 0
            text = self._texts[self._doc[2]]
            if self._char > len(text):
                raise StateError(f"a cursor resumes at character {self._char} of a document of source "
                                 f"{self.reader.source} that has {len(text)}; the data differs from the checkpoint's")
        epoch, index, doc = self._doc
        full, start = self._texts[doc], self._char
        stop = len(full) if self.part_chars is None else next_cut(full, start, self.part_chars)
        last, text, nbytes = stop == len(full), full, int(self._nbytes[doc])
        if start or not last:
            text, nbytes = full[start:stop], nbytes * (stop - start) // len(full)
        if last:
            self._doc = None
        else:
            self._char = stop
        return (epoch, index, start, last), text, max(1, nbytes)  # an empty document still moves readahead on

    def _submit_chunk(self) -> None:
        where: list[tuple[int, int, int, bool]] = []
        texts: list[str] = []
        nbytes = 0
        # before the readahead starts (a start or a restore building its first window), a quarter
        # chunk at a time: the text tokenized past what the window needs is then a quarter chunk
        chunk = self.chunk_bytes if self.readahead_bytes else max(1, self.chunk_bytes // 4)
        while nbytes < chunk and len(texts) < _MAX_CHUNK_DOCS:
            place, text, size = self._next_part()
            where.append(place)
            texts.append(text)
            nbytes += size
        self._pending.append((self.pool.submit(self.tokenizer.encode, texts, [w[3] for w in where]), where, nbytes))
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
            for (epoch, index, char, last), end in zip(where, np.cumsum(lengths).tolist()):
                self._ready.append(TokenizedDocument(flat[start:end], epoch, index, char, self._base, last))
                self._base = 0 if last else self._base + end - start
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
