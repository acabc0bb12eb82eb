"""Plain values: the leaves of a state that travel in the manifest as JSON (never pickled).

A plain value is one of
  * ``None``, ``bool``, ``int`` (64-bit: in ``[-2**63, 2**64)``), ``float`` (NaN, the
    infinities and -0.0 included), ``str``;
  * a hyper-parameter value: ``torch.dtype``, ``torch.device``, a ``pathlib`` path, an
    ``enum.Enum`` member, a class referenced by name (``act=torch.nn.GELU``), or a
    dataclass instance whose fields are plain values;
  * a list or tuple of plain values (inside a dataclass: also a dict of them, keyed by
    str or int).

JSON has no tuples, non-finite floats or the hyper-parameter types, so those are written
as one-key objects with a ``$`` tag from a fixed set (:data:`TAGS`); anything else is
refused by :func:`encode_plain` with a message naming its type and the fix, and a tag or
shape outside that set is refused by :func:`decode_plain` (a manifest is untrusted).

Classes (of enums, dataclasses, and class references) are written as ``"module:qualname"``
and found again on load only in a module that is *already imported* (``sys.modules``),
by attribute lookup: a manifest never makes flexckpt import anything, and nothing it
names is called. A dataclass is rebuilt field by field without calling its ``__init__``
or ``__post_init__`` (``object.__new__``, then each field set as saved), so it compares
equal to the saved one.

Some types come back as their base type: numpy scalars and other subclasses of
``int``/``float``/``str`` (not enums) as the Python scalar, named tuples and
``torch.Size`` as a tuple, a concrete path (``PosixPath``, ``WindowsPath``) as this
host's ``pathlib.Path``.
"""
from __future__ import annotations

import dataclasses
import enum
import math
import pathlib
import re
import sys
from typing import Any

import torch

from flexckpt.state.values import ByLane, PerRank

SCALARS = (bool, int, float, str, type(None))
ATOMS = (torch.dtype, torch.device, pathlib.PurePath, enum.Enum, type)  # besides scalars and dataclasses
MAX_DEPTH = 32  # lists, tuples, dicts and dataclasses nested inside one plain value
MIN_INT, MAX_INT = -(1 << 63), (1 << 64) - 1  # what JSON numbers carry exactly here
TAGS = ("$float", "$tuple", "$dtype", "$device", "$path", "$enum", "$class", "$dataclass", "$dict")

_PATHS = {"PurePath": pathlib.PurePath, "PurePosixPath": pathlib.PurePosixPath,
          "PureWindowsPath": pathlib.PureWindowsPath, "Path": pathlib.Path, "PosixPath": pathlib.Path,
          "WindowsPath": pathlib.Path}
_REF = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_DEVICE = re.compile(r"^[a-z][a-z0-9_]{0,31}(:[0-9]{1,6})?$")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")


def is_plain_atom(value: Any) -> bool:
    """A plain value that is not a list or tuple (the walk's test for a leaf)."""
    return isinstance(value, SCALARS) or isinstance(value, ATOMS) or (
        dataclasses.is_dataclass(value) and not isinstance(value, (ByLane, PerRank)) and not _has_state(value))


def _has_state(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


# -- saving --------------------------------------------------------------------------------------
def encode_plain(value: Any, depth: int = 0) -> Any:
    """The JSON form of a plain value; TypeError or ValueError (naming the type and the
    fix) for one that has none."""
    t = type(value)
    if t is str:
        if not value.isascii():
            value.encode("utf-8")  # a lone surrogate cannot be written: UnicodeEncodeError, a ValueError
        return value
    if value is None or t is bool:
        return value
    if t is int:
        if not MIN_INT <= value <= MAX_INT:
            raise ValueError(f"int {value} does not fit in 64 bits; store it as a str")
        return value
    if t is float:
        return value if math.isfinite(value) else {"$float": repr(value)}
    if depth >= MAX_DEPTH:
        raise ValueError(f"a plain value nested deeper than {MAX_DEPTH} levels cannot be checkpointed; flatten it")
    if t is list:
        return [encode_plain(v, depth + 1) for v in value]
    if isinstance(value, enum.Enum):  # before int and str: IntEnum and StrEnum are both
        cls = type(value)
        ref = class_ref(cls)
        if cls.__members__.get(value.name) is not value:
            raise ValueError(f"enum value {value!r} is not a member found by its name; store its .value")
        return {"$enum": ref, "name": value.name}
    if isinstance(value, tuple):  # named tuples and torch.Size come back as tuples
        return {"$tuple": [encode_plain(v, depth + 1) for v in value]}
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, (int, float, str)):  # numpy scalars and other subclasses: as the base type
        return encode_plain(int(value) if isinstance(value, int) else float(value) if isinstance(value, float)
                            else str(value), depth)
    if isinstance(value, torch.dtype):
        return {"$dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"$device": str(value)}
    if isinstance(value, pathlib.PurePath):
        return {"$path": str(value), "type": type(value).__name__ if type(value).__name__ in _PATHS else "PurePath"}
    if isinstance(value, type):
        return {"$class": class_ref(value)}
    if dataclasses.is_dataclass(value):
        return {"$dataclass": class_ref(type(value)), "fields": {
            f.name: _field(value, f.name, depth) for f in dataclasses.fields(value)}}
    if isinstance(value, dict):
        for k in value:
            if type(k) is not str and type(k) is not int:
                raise TypeError(f"a dict inside a plain value has key {k!r} ({type(k).__name__}); use str or int keys")
        return {"$dict": [[encode_plain(k, depth + 1), encode_plain(v, depth + 1)] for k, v in value.items()]}
    raise TypeError(f"a {t.__module__}.{t.__qualname__} is not a plain value (flexckpt never pickles): use None, "
                    f"bool, int, float, str, torch.dtype, torch.device, pathlib paths, enums, classes, dataclasses, "
                    f"or lists, tuples and dicts of them")


def _field(value: Any, name: str, depth: int) -> Any:
    try:
        return encode_plain(getattr(value, name), depth + 1)
    except (TypeError, ValueError) as e:
        raise type(e)(f"field {name!r} of dataclass {type(value).__qualname__}: {e}; a dataclass is saved as a "
                      f"plain value (keep tensors in the state dict, beside it)") from None


def class_ref(cls: type) -> str:
    """``"module:qualname"`` of a class that can be found again by that name."""
    module, qual = getattr(cls, "__module__", None), getattr(cls, "__qualname__", "")
    ref = f"{module}:{qual}"
    if not isinstance(module, str) or not _REF.match(ref) or _lookup(module, qual) is not cls:
        raise ValueError(f"class {qual or cls!r} (module {module}) cannot be found again by its name "
                         f"{ref!r}; define it at the top level of a module (not inside a function), or store "
                         f"its name as a str")
    return ref


def _lookup(module: str, qual: str) -> Any:
    obj: Any = sys.modules.get(module)
    for part in qual.split("."):
        obj = getattr(obj, part, None) if obj is not None else None
    return obj


# -- loading (untrusted input) ------------------------------------------------------------------
def decode_plain(value: Any, depth: int = 0) -> Any:
    """The value :func:`encode_plain` wrote; ValueError for anything it cannot have written."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if depth >= MAX_DEPTH:
        raise ValueError(f"a plain value nested deeper than {MAX_DEPTH} levels")
    if isinstance(value, list):
        return [decode_plain(v, depth + 1) for v in value]
    if not isinstance(value, dict) or len(value) not in (1, 2):
        raise ValueError(f"unexpected plain value of type {type(value).__name__}")
    tag = next(iter(value))
    body = value[tag]
    fields = set(value)
    if tag == "$float" and fields == {"$float"} and body in ("nan", "inf", "-inf"):
        return float(body)
    if tag == "$tuple" and fields == {"$tuple"} and isinstance(body, list):
        return tuple(decode_plain(v, depth + 1) for v in body)
    if tag == "$dtype" and fields == {"$dtype"} and isinstance(body, str) and _NAME.match(body):
        dtype = getattr(torch, body, None)
        if isinstance(dtype, torch.dtype):
            return dtype
    if tag == "$device" and fields == {"$device"} and isinstance(body, str) and _DEVICE.match(body):
        try:
            return torch.device(body)
        except RuntimeError:  # a device type this torch does not know
            raise ValueError(f"device {body!r} is not a device this torch knows") from None
    if tag == "$path" and fields == {"$path", "type"} and isinstance(body, str) and value["type"] in _PATHS:
        return _PATHS[value["type"]](body)
    if tag == "$enum" and fields == {"$enum", "name"} and isinstance(value["name"], str):
        cls = resolve_class(body)
        if not issubclass(cls, enum.Enum) or value["name"] not in cls.__members__:
            raise ValueError(f"{body} has no enum member {value['name'][:80]!r}")
        return cls.__members__[value["name"]]
    if tag == "$class" and fields == {"$class"}:
        return resolve_class(body)
    if tag == "$dataclass" and fields == {"$dataclass", "fields"} and isinstance(value["fields"], dict):
        return _dataclass(resolve_class(body), value["fields"], depth)
    if tag == "$dict" and fields == {"$dict"} and isinstance(body, list):
        out = {}
        for kv in body:
            if not (isinstance(kv, list) and len(kv) == 2 and type(kv[0]) in (str, int)):
                raise ValueError("a dict inside a plain value must be [[key (str or int), value], ...]")
            out[kv[0]] = decode_plain(kv[1], depth + 1)
        return out
    raise ValueError(f"unexpected object in a plain value (fields {sorted(fields)[:4]}; tags are {', '.join(TAGS)})")


def resolve_class(ref: Any) -> type:
    """The class ``"module:qualname"`` names, in a module already imported; never imports."""
    if not isinstance(ref, str) or len(ref) > 512 or not _REF.match(ref):
        raise ValueError(f"{str(ref)[:80]!r} is not a class reference 'module:qualname'")
    module, qual = ref.split(":")
    if module not in sys.modules:
        raise ValueError(f"the checkpoint refers to class {ref}, and module {module!r} is not imported; import it "
                         f"before loading (flexckpt never imports what a checkpoint names)")
    cls = _lookup(module, qual)
    if not isinstance(cls, type):
        raise ValueError(f"the checkpoint refers to class {ref}, which module {module!r} does not define")
    return cls


def _dataclass(cls: type, raw: dict, depth: int) -> Any:
    if not dataclasses.is_dataclass(cls):
        raise ValueError(f"{cls.__module__}:{cls.__qualname__} is not a dataclass")
    names = [f.name for f in dataclasses.fields(cls)]
    if sorted(raw) != sorted(names):
        raise ValueError(f"dataclass {cls.__qualname__} has fields {names}, the checkpoint holds {sorted(raw)[:20]}")
    values = {name: decode_plain(raw[name], depth + 1) for name in names}
    try:
        obj = object.__new__(cls)  # neither __init__ nor __post_init__ runs: the fields as saved
        for name, value in values.items():
            object.__setattr__(obj, name, value)
    except (TypeError, AttributeError) as e:
        raise ValueError(f"dataclass {cls.__qualname__} cannot be rebuilt field by field: {e}") from None
    return obj
