"""Bit-packed TurboQuant KV caches: the torch and MLX packers against quant/bitpack.py's numpy layout,
the bytes each cache allocates, and the planner's KV bytes against the torch runner's allocation."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from twinfer.formats.bitpack import code_group, pack_bits, pack_rows, packed_width, unpack_bits
from twinfer.planners.formats import KV_FORMATS, turboquant_kv_bits
from twinfer.quant.kv_format import parse_kv_format

BITS = range(1, 9)
WIDTHS = [1, 3, 7, 8, 13, 64, 130]  # odd widths are zero-padded to whole groups of codes


def _codes(bits: int, n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng([bits, n, seed]).integers(0, 1 << bits, (5, 3, n), dtype=np.uint8)


# -- the numpy layout ------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("n", WIDTHS)
def test_pack_rows_round_trips_and_costs_bits_per_code(bits: int, n: int) -> None:
    codes = _codes(bits, n)
    packed = pack_rows(codes, bits)
    group, nbytes = code_group(bits)
    assert packed.shape == (5, 3, packed_width(n, bits)) == (5, 3, -(-n // group) * nbytes)
    assert group * bits == nbytes * 8  # a whole group costs exactly `bits` per code
    np.testing.assert_array_equal(unpack_bits(packed, bits, n), codes)


def test_pack_rows_layout_is_the_little_endian_stream() -> None:
    assert pack_rows(np.array([[1, 2, 3, 4, 5, 6, 7, 0]], np.uint8), 3).tolist() == [[0xD1, 0x58, 0x1F]]
    assert pack_rows(np.array([[0x3, 0xA, 0x1]], np.uint8), 4).tolist() == [[0xA3, 0x01]]
    assert pack_rows(np.array([[1, 0, 0, 1, 1, 1, 1, 1, 1]], np.uint8), 1).tolist() == [[0xF9, 0x01]]
    codes = _codes(2, 64)
    np.testing.assert_array_equal(pack_rows(codes, 2), pack_bits(codes, 2))  # whole groups: no padding


# -- the device packers ----------------------------------------------------------------------------
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("n", WIDTHS)
def test_torch_packing_matches_the_numpy_layout(bits: int, n: int) -> None:
    torch = pytest.importorskip("torch")
    from twinfer.backends.cuda.quant import TorchCodePacking

    codes = _codes(bits, n)
    packing = TorchCodePacking(bits, n, torch.device("cpu"))
    packed = packing.pack(torch.from_numpy(codes))
    assert packed.dtype == torch.uint8 and packing.width == packed_width(n, bits)
    np.testing.assert_array_equal(packed.numpy(), pack_rows(codes, bits))
    back = packing.unpack(packed)
    assert back.dtype == torch.uint8
    np.testing.assert_array_equal(back.numpy(), codes)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("n", WIDTHS)
def test_mlx_packing_matches_the_numpy_layout(bits: int, n: int) -> None:
    mx = pytest.importorskip("mlx.core")
    from twinfer.backends.metal.quant import MlxCodePacking

    codes = _codes(bits, n)
    packing = MlxCodePacking(bits, n)
    packed = packing.pack(mx.array(codes))
    assert packed.dtype == mx.uint8 and packing.width == packed_width(n, bits)
    np.testing.assert_array_equal(np.array(packed), pack_rows(codes, bits))
    back = packing.unpack(packed)
    assert back.dtype == mx.uint8
    np.testing.assert_array_equal(np.array(back), codes)


# -- bytes the caches hold -------------------------------------------------------------------------
# Bytes per token per layer for one KV head, keys + values: packed codes + float16 norms (+ QJL signs
# and residual norm). Before packing, every code and sign took a byte: tq4/tq3 at 128 held 260, tq3-qjl 390.
PER_HEAD = {
    ("tq4", 128): 2 * (64 + 2), ("tq3", 128): 2 * (48 + 2), ("tq3-qjl", 128): (32 + 2 + 16 + 2) + (48 + 2),
    ("tq4", 256): 2 * (128 + 2), ("tq3", 256): 2 * (96 + 2), ("tq3-qjl", 256): (64 + 2 + 32 + 2) + (96 + 2),
    ("tq4-qjl", 128): (48 + 2 + 16 + 2) + (64 + 2), ("tq2.5", 128): 2 * ((24 + 2) + (16 + 2)),
}


@pytest.mark.parametrize("kv,head_dim", list(PER_HEAD))
def test_cache_bytes_per_token_are_the_packed_sizes(kv: str, head_dim: int) -> None:
    torch = pytest.importorskip("torch")
    mx = pytest.importorskip("mlx.core")
    from twinfer.backends.cuda.quant import TorchTQKV
    from twinfer.backends.metal.quant import MlxTQKV

    fmt = parse_kv_format(kv)
    assert fmt is not None
    slots, heads = 32, 2
    held = TorchTQKV(fmt, 0, slots, heads, head_dim, torch.device("cpu"), torch.float32).nbytes
    assert held == slots * heads * PER_HEAD[kv, head_dim]
    assert MlxTQKV(fmt, 0, slots, heads, head_dim, mx.float32).nbytes == held
    assert fmt.bits_per_element(head_dim) * 2 * head_dim / 8 == PER_HEAD[kv, head_dim]


@pytest.mark.parametrize("head_dim", [16, 32, 80, 128, 256])
@pytest.mark.parametrize("kv", ["tq4", "tq3"])
def test_planner_turboquant_bits_are_the_runtime_format_s(kv: str, head_dim: int) -> None:
    fmt = parse_kv_format(kv)
    assert fmt is not None
    assert KV_FORMATS[kv].bits_at(head_dim) == fmt.bits_per_element(head_dim)
    assert KV_FORMATS[kv].bits == turboquant_kv_bits(KV_FORMATS[kv].code_bits, 128)


@pytest.mark.parametrize("head_dim", [16, 128, 256])
@pytest.mark.parametrize("kv", ["tq4", "tq3"])
def test_torch_runner_kv_bytes_match_the_plan(tmp_path: Path, kv: str, head_dim: int) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from test_planner_engine import TOL, planned

    from twinfer.backends.cuda.runner import load_torch_runner
    from twinfer.runtime.loaders import load_model

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=80, head_dim=head_dim)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    plan = planned(tmp_path, 64, "f32", kv)
    assert (plan["engine"], plan["kv_format"]) == ("torch", kv)
    runner = load_torch_runner(load_model(tmp_path), dtype=torch.float32, kv_tokens=64, kv_format=kv)
    per_slot = runner.torch_ops.kv_bytes / (runner.kv.num_blocks * runner.kv.block_size)
    assert plan["memory"]["kv_bytes_per_token"] == pytest.approx(per_slot, rel=TOL)
    bits = {"tq4": 4, "tq3": 3}[kv]
    padded_codes = head_dim * bits // 8  # head_dim is a power of two here
    assert per_slot == 2 * 2 * 2 * (padded_codes + 2)  # layers x (K, V) x KV heads x (packed codes + norm)
