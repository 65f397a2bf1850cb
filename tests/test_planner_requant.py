"""The planner against what llama.cpp's quantizer writes when it requantizes the default model's GGUF.

Reference figures come from files llama.cpp (llama-cpp-python 0.3.36) wrote from Gemma 3 270M Q4_K_M
with `llama_model_quantize` (`backends/llamacpp/requantize.py`), read back with the `gguf` package, and
from KL(stored file || requantized file) measured with docs/quantization.md's `--memory-budget` recipe
(F16 KV, 512 prose tokens in 256-token windows). Only GGUF headers are read here; nothing runs.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from twinfer.planners.catalog import find
from twinfer.planners.formats import FORMATS, MIXES, written_format
from twinfer.planners.model import ModelProfile
from twinfer.planners.source import profile_from_loaded
from twinfer.runtime.loaders import load_model

# Tensor data bytes of the requantized files (file sizes 241,408,704 / 241,961,664 / 241,265,344 /
# 237,077,184 bytes, each with the stored file's 6,525,120-byte header and tokenizer).
WRITTEN_TENSOR_BYTES = {"q4_0": 234_883_584, "q3_k_m": 235_436_544, "iq4_xs": 234_740_224, "q2_k": 230_552_064}
FILE_BYTES = {"q4_0": 241_408_704, "q3_k_m": 241_961_664}
# Per-component types in the Q3_K_M file (18 layers): q/k/gate/up have 640 inputs, so Q3_K fell back to
# Q4_0; attn_output (1024 inputs) and ffn_down (2048) kept their K-quants; the tied embedding is Q8_0.
Q3_K_M_WRITTEN = {
    "embed": {"q8_0": 1.0}, "attn": {"q4_0": 1.0}, "attn_out": {"q4_k": 1.0}, "mlp": {"q4_0": 1.0},
    "attn_v": {"q5_1": 2 / 18, "q5_0": 16 / 18}, "mlp_down": {"q5_k": 1 / 18, "q4_k": 17 / 18},
}
MEASURED_KL = {"q4_0": 0.447, "q3_k_m": 0.230, "iq4_xs": 0.204, "q2_k": 0.554}


@pytest.fixture(scope="module")
def gemma(default_model: Path) -> ModelProfile:
    return profile_from_loaded(load_model(default_model))


def test_fallback_table_follows_llamacpp() -> None:
    assert [written_format(f, 640) for f in ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_xs")] == [
        "q4_0", "q4_0", "q5_0", "q5_1", "q8_0", "iq4_nl"]
    assert [written_format(f, 2048) for f in ("q3_k", "q4_k", "q6_k", "iq4_xs")] == ["q3_k", "q4_k", "q6_k", "iq4_xs"]
    assert written_format("q4_0", 640) == "q4_0" and written_format("q8_0", 640) == "q8_0"


def test_default_model_source_types_and_rows(gemma: ModelProfile) -> None:
    assert gemma.spec.hidden_size == 640 and gemma.tied
    assert gemma.rows("attn") == ((640, 1.0),)
    assert gemma.rows("attn_out") == ((1024, 1.0),) and gemma.rows("mlp_down") == ((2048, 1.0),)
    assert gemma.stored is not None
    assert dict(gemma.stored.split("attn_out")) == {"q4_k": 1.0}  # the o projection is its own component
    assert dict(gemma.stored.split("attn")) == {"q5_0": 1.0}


def test_q3_k_m_components_as_llamacpp_writes_them(gemma: ModelProfile) -> None:
    mix = MIXES["q3_k_m"]
    for comp, want in Q3_K_M_WRITTEN.items():
        got = dict(gemma.split(mix, comp))
        assert set(got) == set(want), comp
        for fmt, share in want.items():
            assert got[fmt] == pytest.approx(share, abs=0.06), (comp, fmt)


@pytest.mark.parametrize("name", sorted(WRITTEN_TENSOR_BYTES))
def test_requantized_bytes_within_3_percent(gemma: ModelProfile, name: str) -> None:
    predicted = gemma.weight_bytes(MIXES[name])
    assert predicted == pytest.approx(WRITTEN_TENSOR_BYTES[name], rel=0.03)
    if name in FILE_BYTES:  # plus the header the stored file carries, the whole file
        assert gemma.stored is not None
        header = 253_113_024 - gemma.weight_bytes(gemma.stored)
        assert header == 6_525_120
        assert predicted + header == pytest.approx(FILE_BYTES[name], rel=0.03)
    # the tied embedding is quantized as the output (Q6_K, which falls back to Q8_0 on 640 inputs), as
    # stored: before that rule the planner said 151 MB for Q4_0 and 121 MB for Q3_K_M
    assert gemma.stored is not None
    assert gemma.bytes_of(MIXES[name], "embed") == gemma.bytes_of(gemma.stored, "embed") == 262144 * 640 * 8.5 / 8


def test_requant_kl_ranks_formats_as_measured(gemma: ModelProfile) -> None:
    kl = {name: gemma.mix_kl(MIXES[name]) for name in MEASURED_KL}
    assert kl["iq4_xs"] < kl["q3_k_m"] < kl["q4_0"]  # measured 0.204 < 0.230 < 0.447
    for name, measured in MEASURED_KL.items():  # fitted on Q4_0 and Q3_K_M; IQ4_XS and Q2_K held out
        assert measured / 1.5 < kl[name] < measured * 1.5, name
    assert gemma.mix_kl(MIXES["q4_k_m"]) == 0.0  # the file's own mix: every tensor copied unchanged
    assert gemma.mix_kl(gemma.stored) == 0.0  # type: ignore[arg-type]


def test_requantized_mixes_rate_by_what_is_written(gemma: ModelProfile) -> None:
    # Q3_K_M writes no Q3_K tensor on this model: its lossiest type is Q4_0/Q4_K ("good"), not Q3_K
    assert gemma.mix_tier(MIXES["q3_k_m"]) == FORMATS["q4_0"].tier
    assert gemma.mix_tier(MIXES["q2_k"]) == FORMATS["q3_k"].tier  # attn_output and ffn_down stay Q3_K


@pytest.mark.parametrize("model", ["llama-3.1-8b", "deepseek-v3"])
def test_rows_divisible_by_256_are_unaffected(model: str) -> None:
    prof = find(model).profile()
    assert not prof.tied
    for comp, count in prof.params:
        if count:
            assert all(row % 256 == 0 for row, _ in prof.rows(comp)), comp
    for name in ("q4_k_m", "q3_k_m", "q4_0", "iq4_xs", "q2_k", "nvfp4", "fp8"):
        mix = MIXES[name]
        for comp, _ in prof.params:
            assert prof.split(mix, comp) == mix.split(comp)
        table_bytes = sum(prof.count(c) * mix.bits(c) / 8 for c, _ in prof.params)
        assert prof.weight_bytes(mix) == pytest.approx(table_bytes, rel=1e-12)
        if prof.is_reference(mix):
            continue  # deepseek-v3 is published in FP8
        table_kl = sum(prof.count(c) * s * FORMATS[f].kl for c, _ in prof.params for f, s in mix.split(c))
        assert prof.mix_kl(mix) == pytest.approx(table_kl / prof.total_params, rel=1e-12)
        assert prof.mix_tier(mix) == FORMATS[mix.default].tier
