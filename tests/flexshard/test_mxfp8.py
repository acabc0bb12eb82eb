"""MXFP8 quantization: bit for bit against torchao's ``to_mx`` (FLOOR mode), against a
scalar reference written from the OCP MX v1.0 spec in plain Python, and against hand-made
vectors for zero, subnormal, saturating, NaN and Inf blocks."""
import math
import struct
import warnings

import pytest
import torch

from flexshard.mxfp8 import MXBlocks, dequantize, quantize, scale_shape, wire_bytes

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from torchao.prototype.mx_formats.mx_tensor import to_mx


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


def torchao_row(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    scale, data = to_mx(x.contiguous(), torch.float8_e4m3fn, block)
    return u8(scale), u8(data)


def blocks_of_many_magnitudes(rows: int, cols: int, lo: int, hi: int, seed: int, block: int = 32) -> torch.Tensor:
    """Random normals, each row block scaled by its own 2^k, k uniform in [lo, hi)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    k = torch.randint(lo, hi, (rows, cols // block), generator=g).float()
    return (x.view(rows, cols // block, block) * torch.exp2(k)[..., None]).view(rows, cols)


# --- an independent scalar reference, straight from the spec -------------------------------

def _e4m3_values() -> list[tuple[float, int]]:
    out = []
    for code in range(0x7F):  # 0x7F is NaN
        e, m = code >> 3, code & 7
        v = (m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
        out.append((v, code))
    return out


E4M3 = _e4m3_values()


def _round_e4m3(v: float) -> int:
    """Nearest E4M3 byte to a finite |v| <= 448, ties to the even code."""
    best = min(E4M3, key=lambda vc: (abs(vc[0] - v), vc[1] & 1))
    return best[1]


def _fp32_bits(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0]


def reference_block(values: list[float]) -> tuple[int, list[int]]:
    """(scale byte, element bytes) for one block, in plain Python."""
    if any(math.isnan(v) or math.isinf(v) for v in values):
        return 0xFF, [0x7F | (0x80 if _fp32_bits(v) >> 31 else 0) for v in values]
    amax = max(abs(v) for v in values)
    exponent = ((_fp32_bits(amax) >> 23) & 0xFF) - 127 - 8
    exponent = max(-127, min(127, exponent))
    out = []
    for v in values:
        scaled = v * 2.0**-exponent  # exact in double
        mag = min(abs(scaled), 448.0)
        sign = 0x80 if _fp32_bits(v) >> 31 else 0
        out.append(sign | _round_e4m3(mag))
    return exponent + 127, out


def reference_rows(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = x.shape
    nb = -(-cols // block)
    scale = torch.empty(rows, nb, dtype=torch.uint8)
    data = torch.empty(rows, cols, dtype=torch.uint8)
    for r in range(rows):
        for b in range(nb):
            vals = [float(v) for v in x[r, b * block : (b + 1) * block]]
            s, d = reference_block(vals)
            scale[r, b] = s
            data[r, b * block : b * block + len(d)] = torch.tensor(d, dtype=torch.uint8)
    return scale, data


# --- against torchao -----------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(3))
def test_row_blocks_match_torchao_bit_for_bit_over_many_magnitudes(seed):
    # k in [-118, 120): every block amax is a normal fp32 whose scale exponent is not clamped
    x = blocks_of_many_magnitudes(256, 512, -118, 120, seed)
    scale, data = quantize(x)
    ao_scale, ao_data = torchao_row(x)
    assert torch.equal(scale, ao_scale)
    assert torch.equal(u8(data), ao_data)


def test_column_blocks_match_torchao_on_the_transpose():
    x = blocks_of_many_magnitudes(512, 192, -60, 60, seed=7).T.contiguous()  # (192, 512)
    mx = quantize(x, blocks="column")
    ao_scale, ao_data = torchao_row(x.T)
    assert torch.equal(mx.scale, ao_scale.T)
    assert torch.equal(u8(mx.data), ao_data.T)


def test_tiles_match_torchao_with_one_1024_element_block_per_tile():
    x = blocks_of_many_magnitudes(128, 256, -30, 30, seed=3)
    mx = quantize(x, blocks="tile")
    tiles = x.view(4, 32, 8, 32).permute(0, 2, 1, 3).reshape(32, 1024)
    ao_scale, ao_data = torchao_row(tiles, block=1024)
    assert torch.equal(mx.scale, ao_scale.view(4, 8))
    assert torch.equal(u8(mx.data), ao_data.view(4, 8, 32, 32).permute(0, 2, 1, 3).reshape(128, 256))


@pytest.mark.parametrize("blocks", ["row", "column", "tile"])
def test_ragged_shapes_pad_the_last_block_with_zeros(blocks):
    x = blocks_of_many_magnitudes(96, 96, -20, 20, seed=11)[:77, :50].contiguous()
    padded = torch.zeros(96, 64)
    padded[:77, :50] = x
    mx, full = quantize(x, blocks=blocks), quantize(padded, blocks=blocks)
    assert tuple(mx.scale.shape) == scale_shape((77, 50), blocks)
    assert torch.equal(mx.scale, full.scale[: mx.scale.shape[0], : mx.scale.shape[1]])
    assert torch.equal(u8(mx.data), u8(full.data)[:77, :50])


def test_bf16_input_quantizes_like_its_exact_fp32_value():
    x = blocks_of_many_magnitudes(32, 128, -10, 10, seed=5).bfloat16()
    a, b = quantize(x), quantize(x.float())
    assert torch.equal(a.scale, b.scale) and torch.equal(u8(a.data), u8(b.data))


# --- against the scalar reference and hand-made vectors ------------------------------------

def test_matches_the_scalar_spec_reference_including_clamped_tiny_and_huge_blocks():
    # k from -135 (subnormal amax, scale clamped to 2^-127) up to 125 (amax near fp32 max)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(24, 96, generator=g)
    k = torch.linspace(-135, 125, 72).round().view(24, 3)
    x = (x.view(24, 3, 32) * torch.exp2(k)[..., None]).view(24, 96)
    assert torch.isfinite(x).all()
    scale, data = quantize(x)
    ref_scale, ref_data = reference_rows(x)
    assert torch.equal(scale, ref_scale)
    assert torch.equal(u8(data), ref_data)


def test_torchao_differs_only_where_the_scale_exponent_clamps_at_minus_127():
    # amax in [2^-126, 2^-118): normal, but floor(log2 amax) - 8 < -127. The spec's scale is
    # 2^-127 (byte 0); torchao writes byte 0 too but divides by its fp32 floor 2^-126, so its
    # elements come out half as large. We follow the spec (checked by the scalar reference).
    x = torch.full((1, 32), 2.0**-120)
    mx = quantize(x)
    ao_scale, ao_data = torchao_row(x)
    assert mx.scale.item() == ao_scale.item() == 0
    assert u8(mx.data)[0, 0].item() == 0x70  # 2^-120 * 2^127 = 128
    assert ao_data[0, 0].item() == 0x68  # 64
    assert reference_block([2.0**-120] * 32) == (0, [0x70] * 32)


def block(*values: float, fill: float = 0.0) -> torch.Tensor:
    vals = list(values) + [fill] * (32 - len(values))
    return torch.tensor([vals], dtype=torch.float32)


@pytest.mark.parametrize(
    "name, x, scale, first_bytes",
    [
        ("zero", block(0.0, -0.0), 0, [0x00, 0x80, 0x00]),
        ("ones", block(fill=1.0), 119, [0x78, 0x78]),  # 1 = 2^-8 * 256, 256 = 0x78
        ("e4m3 max exactly", block(1.75, -1.75, 1.0), 119, [0x7E, 0xFE, 0x78]),
        ("saturating", block(1.99, -1.99, 1.9), 119, [0x7E, 0xFE, 0x7E]),  # 509 -> 448
        # 272 and 304 lie halfway between E4M3 neighbours (256|288, 288|320): the even code wins
        ("round half to even", block(1.0, 1.0625, 1.1875), 119, [0x78, 0x78, 0x7A]),
        ("subnormal amax", block(2.0**-130, -(2.0**-130)), 0, [0x20, 0xA0, 0x00]),  # 2^-3
        # 2^-8, 2^-9 (E4M3's smallest subnormal) and 2^-10 (a tie with zero: even code 0x00)
        ("subnormal elements", block(1.0, 2.0**-16, 2.0**-17, 2.0**-18), 119, [0x78, 0x02, 0x01, 0x00]),
        ("nan", block(float("nan"), -1.0, 2.0, -0.0), 0xFF, [0x7F, 0xFF, 0x7F, 0xFF, 0x7F]),
        ("inf", block(1.0, float("inf"), -float("inf")), 0xFF, [0x7F, 0x7F, 0xFF, 0x7F]),
    ],
)
def test_hand_made_blocks(name, x, scale, first_bytes):
    mx = quantize(x)
    assert mx.scale.tolist() == [[scale]], name
    assert u8(mx.data)[0, : len(first_bytes)].tolist() == first_bytes, name
    ref_scale, ref_bytes = reference_block([float(v) for v in x[0]])
    assert (ref_scale, ref_bytes[: len(first_bytes)]) == (scale, first_bytes), name


def test_a_nan_block_leaves_its_neighbours_alone():
    x = torch.cat([block(fill=1.0), block(float("nan"))], dim=1)
    mx = quantize(x)
    assert mx.scale.tolist() == [[119, 0xFF]]
    assert u8(mx.data)[0, :32].eq(0x78).all() and u8(mx.data)[0, 32:].eq(0x7F).all()


def test_nan_and_inf_blocks_in_column_and_tile_orientation():
    x = torch.ones(64, 64)
    x[40, 3] = float("inf")
    col, tile = quantize(x, blocks="column"), quantize(x, blocks="tile")
    assert col.scale[1, 3].item() == 0xFF and (col.scale == 0xFF).sum() == 1
    assert u8(col.data)[32:, 3].eq(0x7F).all() and u8(col.data)[:32, 3].eq(0x78).all()
    assert tile.scale.tolist() == [[119, 119], [0xFF, 119]]
    assert u8(tile.data)[32:, :32].eq(0x7F).all() and u8(tile.data)[32:, 32:].eq(0x78).all()


# --- dequantize, sizes, errors ---------------------------------------------------------------

@pytest.mark.parametrize("blocks", ["row", "column", "tile"])
def test_dequantize_inverts_quantize_on_values_that_fit(blocks):
    # every element an E4M3 value times a per-tensor power of two: exactly representable
    g = torch.Generator().manual_seed(2)
    codes = torch.randint(0, 0x7F, (64, 96), generator=g, dtype=torch.uint8)
    signs = torch.randint(0, 2, (64, 96), generator=g, dtype=torch.uint8) << 7
    x = (codes | signs).view(torch.float8_e4m3fn).float() * 2.0**-20
    x[:, ::32] = 448.0 * 2.0**-20  # pin every block's amax so no element needs rounding
    x[::32, :] = 448.0 * 2.0**-20
    y = dequantize(quantize(x, blocks=blocks))
    assert torch.equal(y, x)


def test_dequantize_gives_nan_for_nan_scale_and_uses_2_pow_minus_127_for_byte_zero():
    mx = quantize(torch.cat([block(2.0**-130), block(float("nan"))], dim=1))
    y = dequantize(mx)
    assert y[0, 0].item() == 2.0**-130
    assert torch.isnan(y[0, 32:]).all()


def test_wire_bytes_count_one_byte_per_element_and_one_per_block():
    assert wire_bytes((64, 96), "row") == 64 * 96 + 64 * 3
    assert wire_bytes((64, 96), "column") == 64 * 96 + 2 * 96
    assert wire_bytes((50, 96), "tile") == 50 * 96 + 2 * 3
    assert wire_bytes((100,), "row") == 100 + 4


def test_quantize_returns_scale_then_data():
    scale, data = quantize(torch.ones(2, 32))
    assert scale.dtype == torch.uint8 and data.dtype == torch.float8_e4m3fn
    assert isinstance(quantize(torch.ones(2, 32)), MXBlocks)


def test_bad_arguments_name_the_value_and_the_fix():
    with pytest.raises(ValueError, match="column blocks need a 2-D tensor.*blocks='row'"):
        quantize(torch.ones(2, 3, 32), blocks="column")
    with pytest.raises(ValueError, match="blocks must be one of"):
        quantize(torch.ones(2, 32), blocks="diagonal")
    with pytest.raises(TypeError, match="floating-point"):
        quantize(torch.ones(2, 32, dtype=torch.int32))
