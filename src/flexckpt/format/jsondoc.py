"""Checked reading of untrusted JSON documents (a manifest, a record): bounded reprs of bad
values for error messages, typed field getters, bounded ints; and the manifest's own
checksum, the seal written as the document's first field."""
from __future__ import annotations

import re
import reprlib
from typing import Any

import orjson

from flexckpt.errors import ManifestError
from flexckpt.format.checksum import checksum

_SHOW = reprlib.Repr()
_SHOW.maxlevel, _SHOW.maxstring, _SHOW.maxother, _SHOW.maxlist, _SHOW.maxdict = 3, 80, 80, 6, 6


def show(value: Any) -> str:
    """A short repr of an untrusted value: bounded in length and depth (an int nested a
    thousand lists deep must not raise RecursionError in an error message)."""
    return _SHOW.repr(value)


def fail(where: str, msg: str) -> ManifestError:
    return ManifestError(f"invalid checkpoint {where}: {msg}")


def get_field(doc: dict, key: str, kind: type | tuple, where: str) -> Any:
    if key not in doc:
        raise fail(where, f"missing field {show(key)}")
    value = doc[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise fail(where, f"field {show(key)} must be {getattr(kind, '__name__', kind)}, got {type(value).__name__}")
    return value


def get_int(value: Any, lo: int, hi: int, what: str, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise fail(where, f"{what} must be an int in [{lo}, {hi}], got {show(value)}")
    return value


def parse_json(data: bytes, where: str) -> dict:
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise fail(where, f"not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise fail(where, f"expected a JSON object, got {type(doc).__name__}")
    return doc


# -- the manifest's own checksum ----------------------------------------------------------------
SEAL_FIELD = "manifest_checksum"
_SEAL = b'{"' + SEAL_FIELD.encode() + b'":"'
_SEAL_HEX = re.compile(rb"[0-9a-f]{16}")


def seal(body: bytes) -> bytes:
    """The manifest as written: ``body`` (a JSON object as orjson writes it) with the
    checksum of exactly those bytes as its first field. Load verifies it before parsing,
    so a flipped byte anywhere (a plain value, a shape, a lane cursor) fails the load, as a
    flipped byte of a data file does."""
    if not body.startswith(b"{") or body.startswith(b"{}"):
        raise ValueError("a manifest body is a non-empty JSON object")
    return _SEAL + checksum(body).encode() + b'",' + body[1:]


def unseal(data: bytes, where: str = "manifest") -> tuple[bytes, bool]:
    """The document without its checksum field, and whether it had one (checked; a
    manifest written before flexckpt sealed them has none and is returned as it is)."""
    if not data.startswith(_SEAL):
        return data, False
    end = len(_SEAL) + 16
    want = data[len(_SEAL) : end]
    if not _SEAL_HEX.fullmatch(want) or data[end : end + 2] != b'",':
        raise fail(where, f"{SEAL_FIELD} must be 16 hex digits followed by the other fields")
    body = b"{" + data[end + 2 :]
    got = checksum(body)
    if got.encode() != want:
        raise fail(where, f"its checksum is {got}, the {SEAL_FIELD} it records is {want.decode()}: the manifest is "
                           f"damaged or was edited")
    return body, True
