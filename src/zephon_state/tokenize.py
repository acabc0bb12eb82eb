"""Tokenizers and the worker threads that run them.

``load_tokenizer("gpt2")`` builds the real GPT-2 byte-level BPE from the vocabulary bundled in
``assets/gpt2`` (no network); ``load_tokenizer("corpus-bpe-4096")`` reads the 4,096-token
byte-level BPE bundled in ``assets/corpus-bpe-4096`` (trained on flextrain's two corpora; its
provenance is beside it). Any local ``tokenizer.json`` (or a folder holding one) also works,
and another id is fetched from the Hugging Face hub only when the hub is reachable.

Workers are threads calling the tokenizer's batch encoder, which releases the GIL. Processes
would not do: a process forked after the tokenizer ran trips the ``tokenizers`` fork guard.
The pool turns the library's own thread fan-out off (``TOKENIZERS_PARALLELISM=false``, unless
the user set it) so that ``parallelism`` is the number of cores in use.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import queue
import re
import socket
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from .errors import ConfigError, TokenizerNotFound

BUNDLED = ("gpt2", "corpus-bpe-4096")  # folders of assets/
_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>")
_HUB_HOST = ("huggingface.co", 443)


@dataclass(frozen=True, eq=False)
class LoadedTokenizer:
    """A tokenizer ready to encode, with the id that ends each document."""

    id: str
    tokenizer: Tokenizer
    eos_id: int
    sha256: str  # of the tokenizer's full JSON description: what the fingerprint records
    cuts: bool = False  # a document may be tokenized in parts cut at ``next_cut`` (see there)

    def encode(self, texts: Sequence[str], eos: Sequence[bool] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Token ids of each text followed by EOS (only where ``eos[i]``, when given), flat
        (int32), and each text's length including its EOS (int64). Special tokens are not
        added and not parsed from the text."""
        encodings = self.tokenizer.encode_batch_fast(list(texts), add_special_tokens=False)
        ends_doc = [True] * len(encodings) if eos is None else list(eos)
        lengths = np.fromiter((len(e) + d for e, d in zip(encodings, ends_doc)), np.int64, len(encodings))
        ends = np.cumsum(lengths)
        flat = np.empty(int(ends[-1]) if len(ends) else 0, np.int32)
        for e, start in zip(encodings, (ends - lengths).tolist()):
            flat[start : start + len(e)] = e.ids
        flat[ends[np.asarray(ends_doc, dtype=bool)] - 1] = self.eos_id
        return flat, lengths


# A space between two ASCII letters: where the tokenizers that ``cuts_at_spaces`` accepts
# always start a pre-token, so the text from there tokenizes to the tail of the whole text's tokens.
_CUT = re.compile(r"[A-Za-z] [A-Za-z]")


def next_cut(text: str, start: int, at_least: int) -> int:
    """The first safe cut of ``text`` at least ``at_least`` (>= 1) characters after ``start``:
    a space between two ASCII letters, or ``len(text)`` when there is none. For a tokenizer
    with ``cuts``, the tokens of ``text[start:]`` are those of ``text[start:cut]`` followed by
    those of ``text[cut:]`` (tested against whole documents on both shipped corpora)."""
    found = _CUT.search(text, start + at_least - 1)
    return found.start() + 1 if found else len(text)


def cuts_at_spaces(spec: dict) -> bool:
    """Whether ``next_cut``'s cuts keep the tokens of a whole text: no normalizer, GPT-2's
    byte-level pre-tokenizer (its regex has no look-behind or anchor, so matching from a
    pre-token start goes on as it does in the whole text; a space between letters always
    starts one, and ``add_prefix_space`` adds nothing to a text that starts with a space),
    a BPE model without dropout (it encodes each pre-token alone), and no added token that
    holds a space or strips one. ``spec``: the tokenizer's JSON description, parsed. Any
    other tokenizer reads whole documents."""
    pre, model = spec.get("pre_tokenizer") or {}, spec.get("model") or {}
    added_ok = all(
        not (a.get("lstrip") or a.get("rstrip") or a.get("single_word"))
        and not any(c.isspace() for c in str(a.get("content", " ")))
        for a in spec.get("added_tokens") or []
    )
    return (spec.get("normalizer") is None and pre.get("type") == "ByteLevel" and pre.get("use_regex", True) is True
            and model.get("type") == "BPE" and model.get("dropout") is None and added_ok)


def _bundled(tokenizer_id: str) -> Tokenizer:
    folder = resources.files("zephon_state") / "assets" / tokenizer_id
    with resources.as_file(folder) as path:
        if tokenizer_id != "gpt2":
            return Tokenizer.from_file(str(Path(path) / "tokenizer.json"))
        bpe = models.BPE.from_file(str(Path(path) / "encoder.json"), str(Path(path) / "vocab.bpe"))
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def _hub_reachable() -> bool:
    try:
        socket.create_connection(_HUB_HOST, timeout=2).close()
        return True
    except OSError:
        return False


def _resolve(tokenizer_id: str) -> Tokenizer:
    if tokenizer_id in BUNDLED:
        return _bundled(tokenizer_id)
    path = Path(tokenizer_id).expanduser()
    if path.is_dir() and (path / "tokenizer.json").is_file():
        return Tokenizer.from_file(str(path / "tokenizer.json"))
    if path.is_file():
        return Tokenizer.from_file(str(path))
    looks_like_path = tokenizer_id.endswith(".json") or tokenizer_id.startswith((".", "/", "~"))
    if not looks_like_path and _hub_reachable():
        try:
            return Tokenizer.from_pretrained(tokenizer_id)
        except Exception as e:  # the hub's errors vary by version; report them all the same way
            raise TokenizerNotFound(f"tokenizer {tokenizer_id!r}: the hub refused it ({e})") from e
    raise TokenizerNotFound(
        f"tokenizer {tokenizer_id!r} is not bundled (bundled: {', '.join(BUNDLED)}), not a local "
        "tokenizer.json or folder holding one, and the Hugging Face hub is "
        + ("not tried for a path" if looks_like_path else "unreachable")
        + "; pass tokenizer_id='gpt2' or the path of a tokenizer.json"
    )


def _eos_id(tok: Tokenizer, tokenizer_id: str, eos: str | int | None) -> int:
    if isinstance(eos, int):
        if not 0 <= eos < tok.get_vocab_size(with_added_tokens=True):
            raise ConfigError(f"eos={eos} is outside tokenizer {tokenizer_id!r}'s vocabulary")
        return eos
    for name in (eos,) if eos is not None else _EOS_CANDIDATES:
        found = tok.token_to_id(name)
        if found is not None:
            return found
    raise ConfigError(
        f"tokenizer {tokenizer_id!r} has no end-of-document token "
        + (f"{eos!r}" if eos is not None else f"among {list(_EOS_CANDIDATES)}")
        + "; pass tokenize(eos=<token string or id>)"
    )


@functools.lru_cache(maxsize=8)
def load_tokenizer(tokenizer_id: str, eos: str | int | None = None) -> LoadedTokenizer:
    """Load a tokenizer by bundled id (``BUNDLED``), path of a ``tokenizer.json`` (or its folder), or hub id."""
    tok = _resolve(tokenizer_id)
    spec = tok.to_str()
    digest = hashlib.sha256(spec.encode("utf-8")).hexdigest()
    return LoadedTokenizer(tokenizer_id, tok, _eos_id(tok, tokenizer_id, eos), digest, cuts_at_spaces(json.loads(spec)))


class TokenizerPool:
    """``parallelism`` daemon threads that run submitted calls (tokenizer batch encodes) in
    submission order; results come back as futures, and the caller restores the order."""

    def __init__(self, parallelism: int, name: str = "zephon-tokenize") -> None:
        if parallelism < 1:
            raise ConfigError(f"parallelism={parallelism} must be at least 1")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(parallelism)
        ]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable, *args: object) -> Future:
        future: Future = Future()
        self._tasks.put((future, fn, args))
        return future

    def _work(self) -> None:
        while True:
            item = self._tasks.get()
            if item is None:
                return
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # handed to whoever waits on the future
                future.set_exception(e)

    def close(self) -> None:
        """Stop the workers after the call each is running; queued calls are cancelled."""
        if self._closed:
            return
        self._closed = True
        while True:
            try:
                item = self._tasks.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        for _ in self._threads:
            self._tasks.put(None)
