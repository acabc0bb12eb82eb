"""Consolidated weights as Hugging Face lays them out: ``model-0000k-of-0000n.safetensors``
files of at most ``max_shard_size`` bytes each and ``model.safetensors.index.json``,
written a batch of tensors at a time. Each file is the safetensors layout (8-byte
little-endian header length, JSON header, then every tensor's bytes back to back),
written directly: ``safetensors.torch.save_file`` would hold every tensor at once.

Files are written under temporary names and renamed when all are complete, the index
last, so a failed export leaves nothing that looks complete.
"""
from __future__ import annotations

import fnmatch
import json
import os
import re
import struct
import uuid
from dataclasses import dataclass, field

import torch

from flexckpt.errors import CheckpointError
from flexckpt.convert.tensor_stream import (
    DEFAULT_BUDGET, batches, check_new_folder, name_path, open_source, progress_bar, read_tensors,
)

ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
}
CASTS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    """``5GB`` (10**9, as Hugging Face counts), ``500MiB``, or bytes."""
    m = _SIZE.match(str(text))
    if not m or float(m.group(1)) <= 0:
        raise CheckpointError(f"--max-shard-size {text!r} is not a size; use e.g. 5GB, 500MB, 2GiB or a byte count")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "B").upper()])


@dataclass
class SafetensorsReport:
    step: int
    files: list[str] = field(default_factory=list)
    tensors: int = 0
    nbytes: int = 0


def _header(entries: list[tuple[str, str, tuple, int]]) -> bytes:
    """The length-prefixed JSON header for ``(name, dtype, shape, nbytes)`` in file order."""
    doc: dict = {"__metadata__": {"format": "pt"}}
    pos = 0
    for name, dt, shape, nbytes in entries:
        doc[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    raw = json.dumps(doc, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


def export_safetensors(url: str, out_dir: str, step: int | None = None, *, select: list[str] | None = None,
                       strip_prefix: str | None = None, dtype: str | None = None, max_shard_size: str | int = "5GB",
                       budget: int = DEFAULT_BUDGET, progress: bool = False) -> SafetensorsReport:
    limit = max_shard_size if isinstance(max_shard_size, int) else parse_size(max_shard_size)
    if dtype is not None and dtype not in CASTS:
        raise CheckpointError(f"--dtype {dtype!r} is not one of {sorted(CASTS)}")
    cast = CASTS.get(dtype) if dtype else None
    ck, contents = open_source(url, step)
    try:
        chosen = [n for n in contents.tensors if not select or any(fnmatch.fnmatchcase(n, p) for p in select)]
        if not chosen:
            some = ", ".join(list(contents.tensors)[:5])
            raise CheckpointError(f"--select {select} matches no tensor of step {contents.step} (tensors: {some} ...)")
        if strip_prefix and not any(n.startswith(strip_prefix) for n in chosen):
            raise CheckpointError(f"--strip-prefix {strip_prefix!r} starts no selected tensor name (first: {chosen[0]!r})")
        cut = next((n for n in chosen if strip_prefix and n.startswith(strip_prefix + "/")), None)
        if cut is not None:  # 'model' of 'model/w' would name it '.w'
            raise CheckpointError(f"--strip-prefix {strip_prefix!r} leaves {cut[len(strip_prefix):]!r} of {cut!r}; "
                                  f"pass {strip_prefix + '/'!r}")
        out_names = {n: _out_name(n, strip_prefix) for n in chosen}
        if len(set(out_names.values())) != len(out_names):
            raise CheckpointError("two tensors get the same name after --strip-prefix; narrow --select")
        kinds, sizes = {}, {}
        for n in chosen:
            info = contents.tensors[n]
            out_dtype = cast if cast is not None and info.dtype.is_floating_point else info.dtype
            if out_dtype not in ST_DTYPES:
                raise CheckpointError(f"tensor {n!r} is {info.dtype}, which safetensors cannot hold")
            kinds[n] = out_dtype
            sizes[n] = _nbytes(info.shape, out_dtype)
        shards = list(batches(chosen, sizes, limit))
        check_new_folder(out_dir, "output folder")
        report = SafetensorsReport(step=contents.step, tensors=len(chosen), nbytes=sum(sizes.values()))
        final = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        tmp = [os.path.join(out_dir, f".{uuid.uuid4().hex[:8]}-{f}.partial") for f in final]
        bar = progress_bar(report.nbytes, "export-safetensors", progress)
        try:
            for shard, path in zip(shards, tmp):
                with open(path, "wb") as f:
                    f.write(_header([(out_names[n], ST_DTYPES[kinds[n]], contents.tensors[n].shape, sizes[n]) for n in shard]))
                    for run in batches(shard, sizes, budget):
                        for n, t in read_tensors(ck, contents, run).items():
                            t = t.to(kinds[n]).contiguous()
                            if t.numel():
                                f.write(t.reshape(-1).view(torch.uint8).numpy().data)
                            bar.update(sizes[n])
            for path, name in zip(tmp, final):
                os.replace(path, os.path.join(out_dir, name))
            index = {"metadata": {"total_size": report.nbytes},
                     "weight_map": {out_names[n]: final[i] for i, shard in enumerate(shards) for n in shard}}
            part = os.path.join(out_dir, ".model.safetensors.index.json.partial")
            with open(part, "w") as f:
                json.dump(index, f, indent=2, sort_keys=True)
            os.replace(part, os.path.join(out_dir, "model.safetensors.index.json"))
        except BaseException:
            for p in [*tmp, *(os.path.join(out_dir, f) for f in final)]:
                if os.path.exists(p):
                    os.remove(p)
            raise
        finally:
            bar.close()
        report.files = final
        return report
    finally:
        ck.close()


def _nbytes(shape: tuple, dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * torch.empty((), dtype=dtype).element_size()


def _out_name(name: str, strip_prefix: str | None) -> str:
    """``model/layers.0.w`` with ``--strip-prefix model/`` -> ``layers.0.w``; remaining
    nesting levels are joined with dots, as in a PyTorch state dict."""
    if strip_prefix and name.startswith(strip_prefix):
        name = name[len(strip_prefix):]
    return ".".join(name_path(name))
