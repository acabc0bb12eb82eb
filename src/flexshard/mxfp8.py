"""MXFP8 blocks (OCP Microscaling v1.0): E4M3 elements sharing one E8M0 scale per block.

A block is 32 elements along a row (``"row"``, 1x32: the forward matmul's operand), down
a column (``"column"``, 32x1: the backward one's) or a 32x32 tile (``"tile"``). For a block
with largest magnitude ``amax``:

- the scale exponent is ``floor(log2(amax)) - 8`` (8 = E4M3's largest exponent), read off
  amax's fp32 exponent bits and clamped to E8M0's range ``[-127, 127]``; the scale byte is
  that exponent plus 127. An all-zero or subnormal block therefore gets byte 0 (2^-127);
- each element becomes ``x * 2^-exponent``, clamped to +-448 (eager float8 casts in some
  torch versions turn overflow into NaN instead of saturating), then rounded to nearest
  even by the cast to ``float8_e4m3fn``;
- a block whose amax is NaN or Inf gets scale byte 0xFF (E8M0 NaN) and every element byte
  becomes 0x7F (E4M3 NaN) with the element's own sign bit kept (0xFF for negative ones).

A dimension that is not a multiple of the block is padded (with zeros, which never change
an amax) in the last block only; the element data keeps the input's shape.

Everything is vectorised over blocks: one ``amax`` reduction, one multiply, one cast.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Literal

import torch

Blocks = Literal["row", "column", "tile"]
BLOCK_ORIENTATIONS: tuple[str, ...] = ("row", "column", "tile")

E4M3_MAX = 448.0
E4M3_EMAX = 8  # 448 = 1.75 * 2^8
E8M0_BIAS = 127
E8M0_NAN = 0xFF
E4M3_NAN = 0x7F
_CHUNK_ELEMENTS = 1 << 16  # fp32 elements scaled per slab and thread (256 KiB)
_E4M3_TO_FP32 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
_E4M3_TABLES: dict[torch.device, torch.Tensor] = {}


def _e4m3_table(device: torch.device) -> torch.Tensor:
    """The 256-entry E4M3 -> fp32 table on ``device`` (copied there once)."""
    if device.type == "cpu":
        return _E4M3_TO_FP32
    table = _E4M3_TABLES.get(device)
    if table is None:
        table = _E4M3_TABLES[device] = _E4M3_TO_FP32.to(device)
    return table


@dataclass(frozen=True, eq=False)
class MXBlocks:
    """A quantized tensor: ``scale`` holds one E8M0 byte per block (``uint8``), ``data``
    the E4M3 elements (``float8_e4m3fn``, the input's shape). Unpacks as ``(scale, data)``."""

    scale: torch.Tensor
    data: torch.Tensor
    blocks: str = "row"
    block_size: int = 32

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter((self.scale, self.data))


def scale_shape(shape: tuple[int, ...], blocks: Blocks = "row", block_size: int = 32) -> tuple[int, ...]:
    """Shape of the scale tensor for data of ``shape``: one entry per block."""
    shape = tuple(int(s) for s in shape)
    _check_blocks(shape, blocks, block_size)
    if blocks == "row":
        return (*shape[:-1], _ceil_div(shape[-1], block_size))
    rows, cols = shape
    if blocks == "column":
        return (_ceil_div(rows, block_size), cols)
    return (_ceil_div(rows, block_size), _ceil_div(cols, block_size))


def quantize(x: torch.Tensor, block_size: int = 32, blocks: Blocks = "row") -> MXBlocks:
    """Quantize ``x`` (fp32, or anything that casts to it exactly: bf16, fp16) to MXFP8."""
    if not x.is_floating_point():
        raise TypeError(f"quantize takes a floating-point tensor, got {x.dtype}")
    shape = tuple(x.shape)
    _check_blocks(shape, blocks, block_size)
    x = x.to(torch.float32).contiguous()
    padded = _pad_to_blocks(x, blocks, block_size)
    blocked = _blocked_view(padded, blocks, block_size)
    dims = _block_dims(blocks)
    # amax = max(max x, -min x): two fast reductions, no |x| temporary; NaN propagates
    amax = torch.maximum(blocked.amax(dim=dims), blocked.amin(dim=dims).neg_())
    exponent = (((amax.view(torch.int32) >> 23) & 0xFF) - E8M0_BIAS - E4M3_EMAX).clamp_(-E8M0_BIAS, E8M0_BIAS)
    # 2^-exponent built from its bits: biased exponent 127 - exponent lies in [8, 254],
    # a normal fp32 power of two, so the multiply below is exact unless it underflows.
    inverse_scale = _expand(((E8M0_BIAS - exponent) << 23).view(torch.float32), blocks)
    out = torch.empty(padded.shape, dtype=torch.float8_e4m3fn, device=x.device)
    out_blocked = _blocked_view(out, blocks, block_size)
    # Scale, clamp and cast a slab at a time: the fp32 temporary stays small (and in cache)
    # instead of a fresh tensor the size of the input.
    step = _slab_rows(blocked)
    for first in range(0, blocked.shape[0], step):
        rows = slice(first, first + step)
        scaled = blocked[rows] * inverse_scale[rows]
        out_blocked[rows].copy_(scaled.clamp_(-E4M3_MAX, E4M3_MAX))
    data = _unpad(out, shape)
    data = data if data.is_contiguous() else data.contiguous()
    scale = (exponent + E8M0_BIAS).to(torch.uint8)
    bad = ~torch.isfinite(amax)
    if x.device.type != "cpu" or bool(bad.any()):  # on a device: no host sync, always mask
        scale = scale.masked_fill_(bad, E8M0_NAN)
        bad_elements = _unpad(_expand(bad, blocks).expand(blocked.shape).reshape(
            _padded_shape(shape, blocks, block_size)), shape)
        sign = (x.view(torch.int32) >> 24).to(torch.uint8) & 0x80
        data_bytes = torch.where(bad_elements, sign | E4M3_NAN, data.view(torch.uint8))
        data = data_bytes.view(torch.float8_e4m3fn)
    return MXBlocks(scale, data, blocks, block_size)


def dequantize(mx: MXBlocks, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values an MXFP8 tensor stands for: ``element * 2^(scale - 127)``, NaN where the
    scale byte is 0xFF."""
    scale, data, blocks, block_size = mx.scale, mx.data, mx.blocks, mx.block_size
    if scale.dtype != torch.uint8:
        raise TypeError(f"MX scale bytes must be uint8, got {scale.dtype}")
    if tuple(scale.shape) != scale_shape(tuple(data.shape), blocks, block_size):
        raise ValueError(
            f"scale shape {tuple(scale.shape)} does not fit data {tuple(data.shape)} in {blocks} "
            f"blocks of {block_size}; expected {scale_shape(tuple(data.shape), blocks, block_size)}"
        )
    biased = scale.to(torch.int32)
    # byte 0 is 2^-127, an fp32 subnormal: bit pattern 1 << 22; 0xFF is NaN.
    factor = torch.where(biased == 0, torch.tensor(1 << 22, dtype=torch.int32, device=biased.device), biased << 23).view(torch.float32)
    factor = factor.masked_fill(biased == E8M0_NAN, float("nan"))
    shape = tuple(data.shape)
    padded = _pad_to_blocks(data.view(torch.uint8), blocks, block_size)
    src = _blocked_view(padded, blocks, block_size)
    out = torch.empty(padded.shape, dtype=torch.float32, device=data.device)
    table = _e4m3_table(data.device)
    dst = _blocked_view(out, blocks, block_size)
    factor = _expand(factor, blocks)
    step = _slab_rows(src)
    for first in range(0, src.shape[0], step):
        rows = slice(first, first + step)
        # a 256-entry table lookup: torch's float8 -> fp32 cast runs element by element
        codes = src[rows].reshape(-1).to(torch.int32)
        values = torch.index_select(table, 0, codes).view(dst[rows].shape)
        torch.mul(values, factor[rows], out=dst[rows])
    result = _unpad(out, shape)
    return (result if result.is_contiguous() else result.contiguous()).to(dtype)


def wire_bytes(shape: tuple[int, ...], blocks: Blocks = "row", block_size: int = 32) -> int:
    """Bytes of an MXFP8 tensor of ``shape``: one per element plus one per block."""
    n = 1
    for s in shape:
        n *= int(s)
    m = 1
    for s in scale_shape(shape, blocks, block_size):
        m *= s
    return n + m


# --- block geometry -------------------------------------------------------------------------

def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _check_blocks(shape: tuple[int, ...], blocks: str, block_size: int) -> None:
    if blocks not in BLOCK_ORIENTATIONS:
        raise ValueError(f"blocks must be one of {BLOCK_ORIENTATIONS}, got {blocks!r}")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    if blocks == "row" and len(shape) < 1:
        raise ValueError("row blocks need a tensor with at least one dimension; reshape a 0-d tensor to (1,)")
    if blocks != "row" and len(shape) != 2:
        raise ValueError(f"{blocks} blocks need a 2-D tensor, got shape {shape}; use blocks='row' for other ranks")


def _padded_shape(shape: tuple[int, ...], blocks: str, block_size: int) -> tuple[int, ...]:
    def up(n: int) -> int:
        return _ceil_div(n, block_size) * block_size

    if blocks == "row":
        return (*shape[:-1], up(shape[-1]))
    if blocks == "column":
        return (up(shape[0]), shape[1])
    return (up(shape[0]), up(shape[1]))


def _pad_to_blocks(x: torch.Tensor, blocks: str, block_size: int) -> torch.Tensor:
    shape = tuple(x.shape)
    padded = _padded_shape(shape, blocks, block_size)
    if padded == shape:
        return x
    out = x.new_zeros(padded)
    out[tuple(slice(0, s) for s in shape)] = x
    return out


def _unpad(x: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    if tuple(x.shape) == shape:
        return x
    return x[tuple(slice(0, s) for s in shape)]


def _blocked_view(x: torch.Tensor, blocks: str, block_size: int) -> torch.Tensor:
    """Padded data viewed with each block along its own dimension(s)."""
    shape = tuple(x.shape)
    if blocks == "row":
        return x.view(*shape[:-1], shape[-1] // block_size, block_size)
    rows, cols = shape
    if blocks == "column":
        return x.view(rows // block_size, block_size, cols)
    return x.view(rows // block_size, block_size, cols // block_size, block_size)


def _slab_rows(blocked: torch.Tensor) -> int:
    """Leading-dimension rows per slab of about ``_CHUNK_ELEMENTS`` elements per thread
    (each slab is one parallel region: fewer, larger ones when there are more threads)."""
    if blocked.shape[0] == 0:
        return 1
    if blocked.device.type != "cpu":  # a GPU kernel is one launch over the whole tensor
        return blocked.shape[0]
    return max(1, _CHUNK_ELEMENTS * torch.get_num_threads() // max(1, blocked[0].numel()))


def _block_dims(blocks: str) -> tuple[int, ...]:
    return {"row": (-1,), "column": (1,), "tile": (1, 3)}[blocks]


def _expand(per_block: torch.Tensor, blocks: str) -> torch.Tensor:
    """A per-block tensor shaped to broadcast against the blocked view."""
    if blocks == "row":
        return per_block.unsqueeze(-1)
    if blocks == "column":
        return per_block.unsqueeze(1)
    return per_block[:, None, :, None]
