"""Weight formats: bit-exact codecs against torch/MLX, known vectors from the specs, round trips."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from twinfer.formats import fp8, mxfp4, nvfp4
from twinfer.formats.bitpack import pack_bits, pack_nibbles, unpack_bits, unpack_nibbles
from twinfer.formats.e2m1 import E2M1_VALUES, decode_e2m1, encode_e2m1
from twinfer.formats.fp8 import E4M3_TABLE, decode_e4m3, encode_e4m3
from twinfer.quant import affine

HAS_MLX = importlib.util.find_spec("mlx") is not None
needs_mlx = pytest.mark.skipif(not HAS_MLX, reason="mlx is not installed")


def _weights(out: int, inp: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((out, inp)) * rng.uniform(0.01, 3.0, (out, 1))).astype(np.float32)


# --- bit packing -------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_pack_bits_round_trip(bits: int) -> None:
    codes = np.random.default_rng(bits).integers(0, 1 << bits, (5, 64)).astype(np.uint8)
    packed = pack_bits(codes, bits)
    assert packed.shape == (5, 64 * bits // 8)
    assert np.array_equal(unpack_bits(packed, bits, 64), codes)


def test_nibble_order_is_low_first() -> None:
    codes = np.array([[1, 2, 15, 7]], dtype=np.uint8)
    assert pack_nibbles(codes).tolist() == [[0x21, 0x7F]]
    assert pack_bits(codes, 4).tolist() == [[0x21, 0x7F]]
    assert np.array_equal(unpack_nibbles(pack_nibbles(codes)), codes)


# --- affine (MLX layout) -----------------------------------------------------------------------


def test_affine_known_layout() -> None:
    # One group of 0..15 twice: MLX picks the larger edge (15) as bias with scale -1, so q = 15 - w,
    # and packs 8 codes per word lowest bits first.
    w = np.tile(np.arange(16, dtype=np.float32), 2)[None, :]
    p = affine.pack(w, bits=4, group_size=32)
    assert p.scales.tolist() == [[-1.0]] and p.biases.tolist() == [[15.0]]
    assert p.wq.tolist() == [[0x89ABCDEF, 0x01234567, 0x89ABCDEF, 0x01234567]]
    assert np.array_equal(p.unpack(), w)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_affine_round_trip_within_half_step(bits: int, group_size: int) -> None:
    w = _weights(16, 256, seed=bits + group_size)
    p = affine.pack(w, bits, group_size)
    assert p.wq.shape == (16, 256 * bits // 32) and p.scales.shape == (16, 256 // group_size)
    assert p.nbytes == 16 * 256 * bits // 8 + 2 * 4 * 16 * 256 // group_size
    # Half a step, plus what clips at the far edge: MLX snaps the scale so the near edge is exact,
    # which can shrink the covered range slightly.
    g = w.reshape(16, -1, group_size)
    shortfall = np.abs((g.max(-1) - g.min(-1)) - ((1 << bits) - 1) * np.abs(p.scales))
    bound = np.repeat(np.abs(p.scales) * 0.5 + shortfall, group_size, axis=1)
    assert np.all(np.abs(p.unpack() - w) <= bound + 1e-6)


@needs_mlx
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_affine_matches_mlx(bits: int, group_size: int) -> None:
    import mlx.core as mx

    w = _weights(32, 256, seed=7)
    w[0, :group_size] = 0.0  # degenerate groups: all zero, one-signed
    w[1, :group_size] = np.abs(w[1, :group_size])
    w[2, :group_size] = -np.abs(w[2, :group_size])
    p = affine.pack(w, bits, group_size)
    wq, scales, biases = (np.array(a) for a in mx.quantize(mx.array(w), group_size=group_size, bits=bits))
    assert np.array_equal(p.wq, wq)
    np.testing.assert_allclose(p.scales, scales, rtol=1e-6, atol=0)
    np.testing.assert_allclose(p.biases, biases, rtol=1e-6, atol=0)
    ref = mx.dequantize(
        mx.array(p.wq), mx.array(p.scales), mx.array(p.biases), group_size=group_size, bits=bits
    )
    np.testing.assert_allclose(p.unpack(), np.array(ref), rtol=1e-6, atol=1e-6)
    x = np.random.default_rng(1).standard_normal((3, 256)).astype(np.float32)
    y = mx.quantized_matmul(
        mx.array(x),
        mx.array(p.wq),
        mx.array(p.scales),
        mx.array(p.biases),
        transpose=True,
        group_size=group_size,
        bits=bits,
    )
    np.testing.assert_allclose(affine.matmul(x, p), np.array(y), rtol=1e-4, atol=1e-3)


# --- FP8 E4M3 ----------------------------------------------------------------------------------


def test_e4m3_known_codes() -> None:
    vals = np.array([0.0, -0.0, 1.0, -2.0, 448.0, 2.0**-9, 2.0**-6, 0.875 * 2.0**-6, 240.0], np.float32)
    assert encode_e4m3(vals).tolist() == [0x00, 0x80, 0x38, 0xC0, 0x7E, 0x01, 0x08, 0x07, 0x77]
    assert np.isnan(E4M3_TABLE[0x7F]) and np.isnan(E4M3_TABLE[0xFF])
    assert np.isfinite(E4M3_TABLE[[0x7E, 0x78, 0xFE]]).all()  # exponent 15 is finite except S.1111.111
    assert encode_e4m3(np.float32(1000.0)) == 0x7E
    assert encode_e4m3(np.float32(1000.0), saturate=False) == 0x7F


def test_e4m3_decode_matches_torch_all_codes() -> None:
    torch = pytest.importorskip("torch")
    codes = np.arange(256, dtype=np.uint8)
    ref = torch.from_numpy(codes).view(torch.float8_e4m3fn).float().numpy()
    ours = decode_e4m3(codes)
    assert np.array_equal(np.isnan(ref), np.isnan(ours))
    assert np.array_equal(ref[~np.isnan(ref)], ours[~np.isnan(ours)])
    assert np.array_equal(np.signbit(ref), np.signbit(ours))


def test_e4m3_encode_matches_torch_bitwise() -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    mids = (E4M3_TABLE[:126].astype(np.float64) + E4M3_TABLE[1:127]) / 2  # every rounding tie
    special = [464.0, 465.0, 479.0, 480.0, 1e6, np.inf, -np.inf, np.nan, 0.0, -0.0, 2.0**-10, 3 * 2.0**-11]
    x = np.concatenate(
        [rng.standard_normal(20_000) * s for s in (1e-3, 0.02, 1.0, 50.0, 300.0)] + [mids, -mids, special]
    ).astype(np.float32)
    ref = torch.from_numpy(x).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    assert np.array_equal(encode_e4m3(x), ref)


def test_fp8_per_tensor_and_block() -> None:
    w = _weights(300, 260, seed=3)
    p = fp8.pack(w)
    assert np.isclose(p.scale, np.abs(w).max() / 448) and np.abs(decode_e4m3(p.codes)).max() == 448
    # E4M3 keeps 3 mantissa bits: relative error <= 2**-4 above the subnormal range.
    big = np.abs(w) >= 2.0**-6 * p.scale
    assert np.all(np.abs(p.unpack() - w)[big] <= np.abs(w)[big] * 2.0**-4 * (1 + 1e-6))
    b = fp8.pack_block(w)
    assert b.scale_inv.shape == (3, 3) and b.nbytes == 300 * 260 + 9 * 4
    tile = np.abs(w[128:256, 128:256]).max()
    assert np.isclose(b.scale_inv[1, 1], tile / 448)
    w2 = w.copy()
    w2[:128, :128] *= 1000.0  # another tile's scale does not move
    assert np.array_equal(fp8.pack_block(w2).codes[128:, 128:], b.codes[128:, 128:])
    assert np.linalg.norm(b.unpack() - w) <= np.linalg.norm(p.unpack() - w) * 1.05


def test_fp8_block_codes_match_torch_cast() -> None:
    torch = pytest.importorskip("torch")
    w = _weights(256, 384, seed=4)
    b = fp8.pack_block(w)
    s = np.repeat(np.repeat(b.scale_inv, 128, axis=0), 128, axis=1)
    ref = torch.from_numpy(w / s).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    assert np.array_equal(b.codes, ref)


# --- E2M1, NVFP4 -------------------------------------------------------------------------------


def test_e2m1_known_values_and_rounding() -> None:
    assert decode_e2m1(np.arange(8)).tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert np.array_equal(decode_e2m1(np.arange(8, 16)), -decode_e2m1(np.arange(8)))
    assert np.array_equal(encode_e2m1(E2M1_VALUES), np.arange(16))
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)  # halfway: go to the even code
    assert decode_e2m1(encode_e2m1(ties)).tolist() == [0, 1, 1, 2, 2, 4, 4]
    assert decode_e2m1(encode_e2m1(np.array([0.26, 5.01, 7.0, 1e9, -7.0], np.float32))).tolist() == [
        0.5,
        6,
        6,
        6,
        -6,
    ]


def test_nvfp4_known_block() -> None:
    row = np.concatenate([E2M1_VALUES[:8], -E2M1_VALUES[:8]])[None, :]  # every value once, amax 6
    p = nvfp4.pack(row, global_scale=1.0)
    assert p.scales.tolist() == [[0x38]]  # block scale 6 / 6 = 1.0
    assert p.packed[0, :4].tolist() == [0x10, 0x32, 0x54, 0x76]  # even element in the low nibble
    assert np.array_equal(p.unpack(), row)
    p = nvfp4.pack(row * 3.0)
    assert np.isclose(p.global_scale, 18.0 / (6 * 448)) and p.scales.tolist() == [[0x7E]]  # 448
    np.testing.assert_allclose(p.unpack(), row * 3.0, rtol=1e-6)


def test_nvfp4_round_trip_error_bound() -> None:
    w = _weights(32, 512, seed=5)
    p = nvfp4.pack(w)
    assert p.packed.shape == (32, 256) and p.scales.shape == (32, 32)
    assert p.nbytes == 32 * 256 + 32 * 32 + 4
    s = np.repeat(p.block_scales(), 16, axis=1)
    a = np.abs(w) / s
    half_gap = np.where(a < 2, 0.25, np.where(a < 4, 0.5, 1.0))  # saturation error is at most 6/16
    assert np.all(np.abs(p.unpack() - w) <= s * half_gap * (1 + 1e-5))


@needs_mlx
def test_nvfp4_matches_mlx_without_global_scale() -> None:
    import mlx.core as mx

    w = _weights(32, 256, seed=6)
    p = nvfp4.pack(w, global_scale=1.0)
    q, scales = mx.quantize(mx.array(w), mode="nvfp4")
    assert np.array_equal(p.scales, np.array(scales))
    mine, theirs = unpack_nibbles(p.packed), unpack_nibbles(np.array(q).view(np.uint8).reshape(32, 128))
    # ModelOpt keeps the sign of a value that rounds to zero (-0); MLX writes +0.
    assert np.array_equal(mine & 7, theirs & 7) and np.array_equal(mine[mine & 7 > 0], theirs[mine & 7 > 0])
    ref = mx.dequantize(
        mx.array(p.packed.view(np.uint32)), mx.array(p.scales), mode="nvfp4", dtype=mx.float32
    )
    assert np.array_equal(p.unpack(), np.array(ref))


# --- MXFP4 -------------------------------------------------------------------------------------


def test_e8m0_matches_torch() -> None:
    torch = pytest.importorskip("torch")
    codes = np.arange(256, dtype=np.uint8)
    ref = torch.from_numpy(codes).view(torch.float8_e8m0fnu).float().numpy()
    ours = mxfp4.decode_e8m0(codes)
    assert np.isnan(ours[255]) and np.isnan(ref[255])
    assert np.array_equal(ours[:255], ref[:255])


def _gpt_oss_example() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Hand-built [experts=2, out=3, G=2, 16] blocks with the expected dequantized tensor."""
    rng = np.random.default_rng(8)
    codes = rng.integers(0, 16, (2, 3, 2, 32)).astype(np.uint8)
    scales = rng.integers(120, 135, (2, 3, 2)).astype(np.uint8)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    expected = E2M1_VALUES[codes] * (2.0 ** (scales.astype(np.float64) - 127))[..., None]
    return blocks, scales, expected.reshape(2, 3, 64).astype(np.float32)


def test_load_mxfp4_hand_built() -> None:
    blocks = np.zeros((1, 16), np.uint8)
    blocks[0, :2] = [0x21, 0xF7]  # (0.5, 1.0), (6.0, -6.0)
    out = mxfp4.load_mxfp4_tensor(blocks, np.array([128], np.uint8))
    assert out.shape == (32,) and out[:4].tolist() == [1.0, 2.0, 12.0, -12.0] and not out[4:].any()
    blocks, scales, expected = _gpt_oss_example()
    assert np.array_equal(mxfp4.load_mxfp4_tensor(blocks, scales), expected)


def test_load_mxfp4_matches_transformers() -> None:
    pytest.importorskip("torch")
    tf_mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    import torch

    blocks, scales, _ = _gpt_oss_example()
    ref = tf_mxfp4.convert_moe_packed_tensors(
        torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32
    )
    # transformers returns [experts, in, out]; the checkpoint (and we) are [experts, out, in].
    assert np.array_equal(mxfp4.load_mxfp4_tensor(blocks, scales), ref.transpose(1, 2).numpy())


def test_mxfp4_pack_follows_ocp_recipe() -> None:
    w = np.zeros((1, 96), np.float32)
    w[0, :8] = [0, 0.5, 1, 1.5, 2, 3, 4, 6]  # amax 6: shared exponent floor(log2 6) - 2 = 0
    w[0, 32:34] = [7.9, -0.1]  # amax 7.9: exponent 0 again, 7.9 saturates to 6
    w[0, 64:66] = [0.75, 0.01]  # amax 0.75: exponent -3, 0.01 -> 0
    p = mxfp4.pack(w)
    assert p.scales.tolist() == [[127, 127, 124]]
    assert p.blocks.shape == (1, 3, 16)
    assert np.array_equal(p.unpack()[0, :8], w[0, :8])
    assert p.unpack()[0, 32:34].tolist() == [6.0, -0.0]
    assert p.unpack()[0, 64:66].tolist() == [0.75, 0.0]


@needs_mlx
def test_mxfp4_decode_matches_mlx() -> None:
    import mlx.core as mx

    w = _weights(16, 256, seed=9)
    q, scales = mx.quantize(mx.array(w), mode="mxfp4")
    blocks = np.array(q).view(np.uint8).reshape(16, 8, 16)  # MLX's uint32 words are gpt-oss bytes
    ref = mx.dequantize(q, scales, mode="mxfp4", dtype=mx.float32)
    assert np.array_equal(mxfp4.load_mxfp4_tensor(blocks, np.array(scales)), np.array(ref))


# --- every format: reference matmul and storage --------------------------------------------------


@pytest.mark.parametrize(
    ("module", "pack", "max_rel_err", "bits"),
    [
        (affine, lambda w: affine.pack(w, 8, 64), 0.01, 8 + 64 / 64),
        (affine, lambda w: affine.pack(w, 4, 64), 0.12, 4 + 64 / 64),
        (fp8, fp8.pack, 0.04, 8.0),
        (fp8, fp8.pack_block, 0.04, 8.0),
        (nvfp4, nvfp4.pack, 0.12, 4.5),
        (mxfp4, mxfp4.pack, 0.15, 4.25),
    ],
)
def test_reference_matmul_and_size(module, pack, max_rel_err: float, bits: float) -> None:
    w = _weights(64, 256, seed=10)
    x = np.random.default_rng(11).standard_normal((5, 256)).astype(np.float32)
    p = pack(w)
    deq = module.unpack(p)
    assert deq.shape == w.shape and deq.dtype == np.float32
    np.testing.assert_allclose(module.matmul(x, p), x @ deq.T, rtol=1e-5, atol=1e-4)
    assert np.linalg.norm(deq - w) / np.linalg.norm(w) < max_rel_err
    assert abs(p.nbytes * 8 / w.size - bits) < 0.01
