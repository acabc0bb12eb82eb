"""The dtypes a checkpoint may hold, by their manifest names."""
from __future__ import annotations

import torch

_DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "complex64": torch.complex64,
    "complex128": torch.complex128,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu", "uint16", "uint32", "uint64"):
    if hasattr(torch, _name):
        _DTYPES[_name] = getattr(torch, _name)

_NAMES = {dt: name for name, dt in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _NAMES[dtype]
    except KeyError:
        raise TypeError(f"dtype {dtype} cannot be checkpointed; supported: {sorted(_DTYPES)}") from None


def dtype_from_name(name: object) -> torch.dtype:
    if not isinstance(name, str) or name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r} in checkpoint; supported: {sorted(_DTYPES)}")
    return _DTYPES[name]


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size() if not hasattr(dtype, "itemsize") else dtype.itemsize
