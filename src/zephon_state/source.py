"""Sources: where documents come from (JSON Lines, plain text files, in-memory lists).

A source is loaded once at start into a ``Documents`` table: the texts, their UTF-8 sizes and
a content digest. Every document is then addressed by its index, which is what lane cursors
store. Bad records (invalid JSON, not an object, missing field, not a string, not UTF-8) are
counted per reason and reported, never silently dropped; the "raise" policy stops instead.
"""
from __future__ import annotations

import hashlib
import logging
import posixpath
from dataclasses import dataclass
from typing import Any, Literal, Mapping, Sequence

import numpy as np
import orjson

from .errors import BadRecordError, ConfigError
from .storage import IoOptions, expand, read_bytes

log = logging.getLogger(__name__)

BadRecordPolicy = Literal["count", "raise"]
_REASONS = {
    "invalid_json": "is not valid JSON",
    "not_an_object": "is not a JSON object",
    "missing_field": "has no field {field!r}",
    "not_a_string": "has a field {field!r} that is not a string",
    "not_utf8": "is not valid UTF-8",
}
_EXAMPLES = 5


@dataclass(frozen=True)
class SourceReport:
    """What loading a source found: good documents, their bytes, bad records per reason."""

    name: str
    documents: int
    bytes: int
    bad: Mapping[str, int]
    examples: tuple[str, ...] = ()

    @property
    def bad_total(self) -> int:
        return sum(self.bad.values())


@dataclass(frozen=True, eq=False)
class Documents:
    """A loaded source: texts addressed by index, their UTF-8 sizes, and a content digest."""

    name: str
    kind: str
    texts: Sequence[str]
    nbytes: np.ndarray  # int64, one per document
    sha256: str
    report: SourceReport

    def __len__(self) -> int:
        return len(self.texts)


class _Collector:
    def __init__(self, name: str, field_name: str | None, policy: BadRecordPolicy) -> None:
        self.name, self.field, self.policy = name, field_name, policy
        self.texts: list[str] = []
        self.bad: dict[str, int] = {}
        self.examples: list[str] = []
        self.digest = hashlib.sha256()

    def bad_record(self, reason: str, where: str) -> None:
        what = _REASONS[reason].format(field=self.field)
        if self.policy == "raise":
            raise BadRecordError(
                f"source {self.name!r}: record at {where} {what}; fix the record, or set "
                ".options(bad_records='count') to skip bad records and count them"
            )
        self.bad[reason] = self.bad.get(reason, 0) + 1
        if len(self.examples) < _EXAMPLES:
            self.examples.append(f"{where}: {what}")

    def record(self, rec: Any, where: str) -> None:
        if not isinstance(rec, dict):
            self.bad_record("not_an_object", where)
        elif self.field not in rec:
            self.bad_record("missing_field", where)
        elif not isinstance(rec[self.field], str):
            self.bad_record("not_a_string", where)
        else:
            self.texts.append(rec[self.field])

    def documents(self, kind: str) -> Documents:
        nbytes = np.fromiter((len(t.encode("utf-8")) for t in self.texts), np.int64, len(self.texts))
        report = SourceReport(self.name, len(self.texts), int(nbytes.sum()), dict(self.bad), tuple(self.examples))
        if report.bad_total:
            log.warning(
                "source %r: skipped %d bad records %s (first: %s)",
                self.name, report.bad_total, dict(self.bad), self.examples[0],
            )
        return Documents(self.name, kind, self.texts, nbytes, self.digest.hexdigest(), report)


def _stem(url: str) -> str:
    base = posixpath.basename(url.rstrip("/"))
    for suffix in (".gz", ".zst", ".zstd", ".jsonl", ".ndjson", ".json", ".txt"):
        if base.endswith(suffix):
            base = base[: -len(suffix)]
    return base or url


def _paths(paths: str | Sequence[str]) -> tuple[str, ...]:
    out = (paths,) if isinstance(paths, str) else tuple(paths)
    if not out or not all(isinstance(p, str) and p for p in out):
        raise ConfigError(f"source paths must be a non-empty string or list of strings, got {paths!r}")
    return out


class Source:
    """A place documents come from. ``load`` reads it whole, in a fixed order."""

    name: str
    kind: str

    def load(self, field_name: str, io: IoOptions, policy: BadRecordPolicy) -> Documents:
        raise NotImplementedError

    def text_field(self, default: str) -> str | None:
        """The record field this source reads its text from (None: its records are texts)."""
        return getattr(self, "field", None) or default


@dataclass(frozen=True)
class JsonLines(Source):
    """JSON Lines files (plain, ``.gz`` or ``.zst``), local or remote; globs are expanded and
    sorted. ``field`` overrides the pipeline's ``tokenize(field=...)`` for this source.
    Whitespace-only lines are not records."""

    paths: str | Sequence[str]
    field: str | None = None
    name: str = ""
    kind: str = "jsonl"

    def __post_init__(self) -> None:
        object.__setattr__(self, "paths", _paths(self.paths))
        if not self.name:
            object.__setattr__(self, "name", _stem(self.paths[0]))

    def load(self, field_name: str, io: IoOptions, policy: BadRecordPolicy) -> Documents:
        sink = _Collector(self.name, self.field or field_name, policy)
        for url in (u for p in self.paths for u in expand(p, io)):
            raw = read_bytes(url, io)
            sink.digest.update(hashlib.sha256(raw).digest())
            for lineno, line in enumerate(raw.split(b"\n"), 1):
                if not line.strip():
                    continue
                try:
                    rec = orjson.loads(line)
                except orjson.JSONDecodeError:
                    sink.bad_record("invalid_json", f"{url}:{lineno}")
                    continue
                sink.record(rec, f"{url}:{lineno}")
        return sink.documents(self.kind)


@dataclass(frozen=True)
class TextFiles(Source):
    """Plain UTF-8 text files (plain, ``.gz`` or ``.zst``): one document per file
    (``unit="file"``) or per non-empty line (``unit="line"``)."""

    paths: str | Sequence[str]
    unit: Literal["file", "line"] = "file"
    name: str = ""
    kind: str = "text"

    def __post_init__(self) -> None:
        object.__setattr__(self, "paths", _paths(self.paths))
        if self.unit not in ("file", "line"):
            raise ConfigError(f"TextFiles unit={self.unit!r} is not one of 'file', 'line'")
        if not self.name:
            object.__setattr__(self, "name", _stem(self.paths[0]))

    def load(self, field_name: str, io: IoOptions, policy: BadRecordPolicy) -> Documents:
        sink = _Collector(self.name, None, policy)
        for url in (u for p in self.paths for u in expand(p, io)):
            raw = read_bytes(url, io)
            sink.digest.update(hashlib.sha256(raw).digest())
            pieces = [raw] if self.unit == "file" else raw.split(b"\n")
            for lineno, piece in enumerate(pieces, 1):
                if self.unit == "line" and not piece.strip():
                    continue
                try:
                    sink.texts.append(piece.decode("utf-8"))
                except UnicodeDecodeError:
                    sink.bad_record("not_utf8", url if self.unit == "file" else f"{url}:{lineno}")
        return sink.documents(f"{self.kind}-{self.unit}")

    def text_field(self, default: str) -> str | None:
        return None


@dataclass(frozen=True, eq=False)
class InMemory(Source):
    """A list of strings (each one document) or of dicts (the text in ``field``)."""

    records: Sequence[str | Mapping[str, Any]]
    field: str | None = None
    name: str = "memory"
    kind: str = "memory"

    def load(self, field_name: str, io: IoOptions, policy: BadRecordPolicy) -> Documents:
        sink = _Collector(self.name, self.field or field_name, policy)
        for i, rec in enumerate(self.records):
            where = f"[{i}]"
            if isinstance(rec, str):
                sink.texts.append(rec)
            else:
                sink.record(rec, where)
        try:
            sink.digest.update(orjson.dumps(list(self.records)))
        except TypeError:  # records orjson cannot encode still need a stable identity
            sink.digest.update(repr(list(self.records)).encode("utf-8"))
        return sink.documents(self.kind)


def as_source(value: "Source | str | Sequence[str | Mapping[str, Any]]") -> Source:
    """A ``Source`` from what a user passes to ``Pipeline``: a source, a path (JSON Lines when it
    ends in ``.jsonl``/``.json``/``.ndjson``, optionally ``.gz``/``.zst``, else text files),
    or an in-memory list of texts or records."""
    if isinstance(value, Source):
        return value
    if isinstance(value, str):
        stripped = value
        for suffix in (".gz", ".zst", ".zstd"):
            stripped = stripped[: -len(suffix)] if stripped.endswith(suffix) else stripped
        if stripped.endswith((".jsonl", ".json", ".ndjson")):
            return JsonLines(value)
        return TextFiles(value)
    if isinstance(value, (list, tuple)):
        return InMemory(value)
    raise ConfigError(
        f"cannot read documents from a {type(value).__name__}; pass a path, a list of texts, "
        "or a JsonLines / TextFiles / InMemory source"
    )
