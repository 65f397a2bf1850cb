"""Weight and KV-cache formats as the planner sees them: bits per weight, what they compute in, what they cost.

A `Mix` says which `Format` each component is stored in (bits include block scales). A format whose
`compute` dtype the device lists as native is multiplied directly; any other pays `dequant_ops` per weight."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from twinfer.runtime.errors import PlanError

# Fidelity tiers: 0 lossless, 1 near-lossless (KL ~1e-3), 2 good (KL ~1e-2), 3 lossy, 4 very lossy.
LOSSLESS, NEAR, GOOD, LOSSY, VERY_LOSSY = range(5)


@dataclass(frozen=True)
class Format:
    name: str
    bits: float  # stored bits per weight, block scales included
    compute: str  # dtype the matrix units need: "bf16", "f16", "fp8", "fp4", "f32"
    dequant_ops: float  # vector ops per weight to expand into `compute` when it is not native
    tier: int
    family: str  # "float", "gguf", "fp", "int", "turboquant"
    kl: float = 0.0  # typical KL(original || quantized) per token; only ranks formats of one tier
    note: str = ""


_F = Format
FORMATS: dict[str, Format] = {f.name: f for f in [
    _F("f32", 32.0, "f32", 0.0, LOSSLESS, "float"),
    _F("bf16", 16.0, "bf16", 0.0, LOSSLESS, "float"),
    _F("f16", 16.0, "f16", 0.0, LOSSLESS, "float"),
    _F("fp8", 8.0, "fp8", 1.0, NEAR, "fp", 0.001, "E4M3 with per-channel or 128-block scales"),
    _F("nvfp4", 4.5, "fp4", 2.0, GOOD, "fp", 0.012, "E2M1 + an FP8 scale per 16 weights"),
    _F("mxfp4", 4.25, "fp4", 2.0, GOOD, "fp", 0.02, "E2M1 + an E8M0 scale per 32 weights"),
    _F("int8", 8.25, "int8", 1.0, NEAR, "int", 0.001, "W8A16, a 16-bit scale per 64 weights"),
    _F("int4", 4.25, "int4", 3.0, GOOD, "int", 0.015, "W4A16 (AWQ/GPTQ), a 16-bit scale and zero per 128 weights"),
    _F("q8_0", 8.5, "int8", 1.5, NEAR, "gguf", 0.0005),
    _F("q6_k", 6.5625, "int8", 3.0, NEAR, "gguf", 0.002),
    _F("q5_k", 5.5, "int8", 3.0, GOOD, "gguf", 0.006),
    _F("q5_0", 5.5, "int8", 2.5, GOOD, "gguf", 0.008),
    _F("q5_1", 6.0, "int8", 2.5, GOOD, "gguf", 0.007),
    _F("q4_k", 4.5, "int8", 3.0, GOOD, "gguf", 0.015),
    _F("q4_0", 4.5, "int8", 2.0, GOOD, "gguf", 0.03),
    _F("q4_1", 5.0, "int8", 2.0, GOOD, "gguf", 0.025),
    _F("iq4_xs", 4.25, "int8", 4.0, GOOD, "gguf", 0.014),
    _F("iq4_nl", 4.5, "int8", 3.5, GOOD, "gguf", 0.016),
    _F("q3_k", 3.4375, "int8", 3.5, LOSSY, "gguf", 0.05),
    _F("iq3_xxs", 3.0625, "int8", 5.0, LOSSY, "gguf", 0.06),
    _F("q2_k", 2.625, "int8", 3.5, VERY_LOSSY, "gguf", 0.2),
    _F("iq2_xxs", 2.0625, "int8", 5.0, VERY_LOSSY, "gguf", 0.3),
    _F("tq1_0", 1.6875, "int8", 4.0, VERY_LOSSY, "gguf", 1.0),
    _F("tq2_0", 2.0625, "int8", 3.0, VERY_LOSSY, "gguf", 0.8),
    # TurboQuant-style: random rotation + a scalar codebook; the lookup and the rotation cost ALU time.
    _F("tq4", 4.125, "f16", 6.0, GOOD, "turboquant", 0.012, "rotated 4-bit codebook, one norm per 128 weights"),
    _F("tq3", 3.125, "f16", 6.0, LOSSY, "turboquant", 0.04, "rotated 3-bit codebook, one norm per 128 weights"),
]}

# GGUF tensor type ids (ggml_type) -> format name, for tensors a loader reports by type.
GGML_TYPES = {
    0: "f32", 1: "f16", 2: "q4_0", 3: "q4_1", 6: "q5_0", 7: "q5_1", 8: "q8_0", 10: "q2_k", 11: "q3_k",
    12: "q4_k", 13: "q5_k", 14: "q6_k", 16: "iq2_xxs", 18: "iq3_xxs", 20: "iq4_nl", 23: "iq4_xs",
    30: "bf16", 34: "tq1_0", 35: "tq2_0", 39: "mxfp4",
}

# Model components a mix assigns formats to (model.py counts parameters per component). `attn` is the
# q and k projections (MLA: its down/up projections), `attn_out` the output projection.
COMPONENTS = ("embed", "lm_head", "attn", "attn_v", "attn_out", "mlp", "mlp_down", "experts", "experts_down",
              "shared", "router", "norm")

# K-quants and IQ types pack rows in super-blocks of QK_K weights; llama.cpp's quantizer gives a tensor
# whose row length is not a multiple another type (`convert_incompatible_tensor`; docs/quantization.md)
QK_K = 256
KQUANT_FALLBACK = {
    "q2_k": "q4_0", "q3_k": "q4_0", "q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0",
    "iq2_xxs": "iq4_nl", "iq3_xxs": "iq4_nl", "iq4_xs": "iq4_nl", "tq1_0": "q4_0", "tq2_0": "q4_0",
}


def written_format(fmt: str, row_length: int) -> str:
    """The type llama.cpp writes for `fmt` on rows of `row_length` weights (a K-quant may not fit them)."""
    return KQUANT_FALLBACK[fmt] if fmt in KQUANT_FALLBACK and row_length % QK_K else fmt


@dataclass(frozen=True)
class Mix:
    """A weight format for a whole model: `default` except the listed components, which may split
    between two formats (`(fmt, share)` pairs, as llama.cpp's `_M` mixes do)."""

    name: str
    default: str
    parts: tuple[tuple[str, tuple[tuple[str, float], ...]], ...] = ()
    label: str = ""
    engines: tuple[str, ...] = ()  # runners that can execute it ("" = any)
    exact: tuple[tuple[str, float], ...] = ()  # measured bits per component (a GGUF's stored sizes)
    notes: tuple[str, ...] = field(default_factory=tuple)
    writer: str = ""  # "llamacpp": written by llama.cpp's quantizer, whose per-tensor rules model.py applies
    embed_type: str = ""  # llamacpp: the type asked for the token embedding and output (`with_embed`)

    def split(self, component: str) -> tuple[tuple[str, float], ...]:
        for comp, formats in self.parts:
            if comp == component:
                return formats
        if component in ("norm", "router"):
            return (("f32", 1.0),)
        return ((self.default, 1.0),)

    def bits(self, component: str) -> float:
        for comp, bits in self.exact:
            if comp == component:
                return bits
        return sum(FORMATS[f].bits * share for f, share in self.split(component))

    def formats(self) -> set[str]:
        return {f for comp in COMPONENTS for f, _ in self.split(comp)}

    @property
    def quantizer_mix(self) -> str:
        """The llama.cpp mix (LLAMA_FTYPE) this one is written with: its name without `+embed_<type>`."""
        return self.name.split("+", 1)[0]

    @property
    def family(self) -> str:
        return FORMATS[self.default].family


def _half(a: str, b: str) -> tuple[tuple[str, float], ...]:
    return ((a, 0.5), (b, 0.5))


def _gguf(name: str, default: str, v_down: tuple[tuple[str, float], ...] | None, out: str,
          embed: str | None = None, attn_out: str | None = None) -> Mix:
    parts: list[tuple[str, tuple[tuple[str, float], ...]]] = [("lm_head", ((out, 1.0),))]
    if v_down:
        parts += [("attn_v", v_down), ("mlp_down", v_down), ("experts_down", v_down)]
    if embed:
        parts.append(("embed", ((embed, 1.0),)))
    if attn_out:
        parts.append(("attn_out", ((attn_out, 1.0),)))
    return Mix(name, default, tuple(parts), label=name.upper(), engines=("llamacpp",), writer="llamacpp")


# llama.cpp's mixes as `llama_tensor_get_type` (src/llama-quant.cpp) writes them: output in Q6_K for most
# types (a tied embedding as the output), `_M` types raising attn_v/ffn_down in about half the layers.
MIXES: dict[str, Mix] = {m.name: m for m in [
    Mix("bf16", "bf16", label="BF16"),
    Mix("f16", "f16", label="F16", engines=("llamacpp", "torch", "mlx")),
    Mix("f32", "f32", label="F32"),
    Mix("fp8", "fp8", (("embed", (("bf16", 1.0),)), ("lm_head", (("bf16", 1.0),))), label="FP8"),
    Mix("nvfp4", "nvfp4", (("embed", (("bf16", 1.0),)), ("lm_head", (("bf16", 1.0),)), ("attn", (("fp8", 1.0),)),
                           ("attn_v", (("fp8", 1.0),)), ("attn_out", (("fp8", 1.0),))), label="NVFP4"),
    Mix("mxfp4", "mxfp4", (("embed", (("bf16", 1.0),)), ("lm_head", (("bf16", 1.0),)), ("attn", (("fp8", 1.0),)),
                           ("attn_v", (("fp8", 1.0),)), ("attn_out", (("fp8", 1.0),))), label="MXFP4"),
    # gpt-oss as published: MXFP4 experts, everything else BF16.
    Mix("mxfp4-moe", "bf16", (("experts", (("mxfp4", 1.0),)), ("experts_down", (("mxfp4", 1.0),))),
        label="MXFP4 experts + BF16"),
    # Kimi K2.5 as published: symmetric INT4 experts in groups of 32 (compressed-tensors), everything else BF16.
    Mix("int4-moe", "bf16", (("experts", (("int4", 1.0),)), ("experts_down", (("int4", 1.0),))),
        label="INT4 experts + BF16"),
    # The same checkpoint converted to GGUF by ggml-org: MXFP4 experts, Q8_0 elsewhere.
    Mix("gguf-mxfp4", "q8_0", (("experts", (("mxfp4", 1.0),)), ("experts_down", (("mxfp4", 1.0),))),
        label="MXFP4 experts + Q8_0 (GGUF)", engines=("llamacpp",)),
    Mix("int8", "int8", (("embed", (("bf16", 1.0),)), ("lm_head", (("bf16", 1.0),))), label="INT8 W8A16"),
    Mix("int4", "int4", (("embed", (("bf16", 1.0),)), ("lm_head", (("bf16", 1.0),))), label="INT4 W4A16 (AWQ)"),
    _gguf("q8_0", "q8_0", None, "q8_0"),
    _gguf("q6_k", "q6_k", None, "q6_k"),
    _gguf("q5_k_m", "q5_k", _half("q6_k", "q5_k"), "q6_k"),
    _gguf("q4_k_m", "q4_k", _half("q6_k", "q4_k"), "q6_k"),
    _gguf("q4_k_s", "q4_k", _half("q5_k", "q4_k"), "q6_k"),
    _gguf("q4_0", "q4_0", None, "q6_k"),
    _gguf("iq4_xs", "iq4_xs", None, "q6_k"),
    _gguf("q3_k_m", "q3_k", (("q5_k", 1 / 16), ("q4_k", 15 / 16)), "q6_k", attn_out="q4_k"),
    _gguf("q2_k", "q2_k", _half("q4_k", "q3_k"), "q6_k", attn_out="q3_k"),
    Mix("tq4", "tq4", (("embed", (("q8_0", 1.0),)), ("lm_head", (("q8_0", 1.0),))),
        label="TurboQuant-style 4-bit", engines=("torch", "mlx")),
    Mix("tq3", "tq3", (("embed", (("q8_0", 1.0),)), ("lm_head", (("q6_k", 1.0),))),
        label="TurboQuant-style 3-bit", engines=("torch", "mlx")),
]}


# Types a llama.cpp requantization may give the token embedding and output matrix (`with_embed`): the one
# lever on a small model with a large tied vocabulary (docs/quantization.md, "The embedding is the lever").
EMBED_TYPES = ("q6_k", "q5_0", "q4_0")


def with_embed(base: Mix, fmt: str) -> Mix:
    """`base` with the token embedding and output matrix quantized to `fmt` too (llama.cpp's
    `token_embedding_type`/`output_tensor_type`), named `<base>+embed_<fmt>`."""
    if base.writer != "llamacpp" or base.embed_type:
        raise PlanError(f"an embedding type applies to a llama.cpp mix, not to {base.label or base.name}")
    if fmt not in FORMATS or FORMATS[fmt].family not in ("gguf", "float"):
        raise PlanError(f"unknown embedding type {fmt!r}; try one of {', '.join(EMBED_TYPES)}")
    parts = tuple(p for p in base.parts if p[0] not in ("embed", "lm_head"))
    parts += (("embed", ((fmt, 1.0),)), ("lm_head", ((fmt, 1.0),)))
    return replace(base, name=f"{base.name}+embed_{fmt}", parts=parts,
                   label=f"{base.label} + embedding {fmt.upper()}", embed_type=fmt)


@dataclass(frozen=True)
class KVFormat:
    name: str
    bits: float  # stored bits per element; TurboQuant's at head_dim 128 (`bits_at` for others)
    compute: str
    dequant_ops: float
    tier: int
    label: str
    kl: float = 0.0
    family: str = "float"  # "gguf" and "turboquant" always go through a dequantization loop
    code_bits: int = 0  # TurboQuant: bits per code

    def bits_at(self, head_dim: int) -> float:
        """Stored bits per element on attention heads of `head_dim` (only TurboQuant's depend on it)."""
        return turboquant_kv_bits(self.code_bits, head_dim) if self.family == "turboquant" else self.bits


def turboquant_kv_bits(bits: int, head_dim: int) -> float:
    """Bits per element of the torch/MLX TurboQuant KV cache at `bits` on `head_dim`: codes over
    next_pow2(head_dim) dims plus a float16 norm (4-bit on 128: 4.125)."""
    padded = 1 << max(0, (head_dim - 1).bit_length())  # quant.hadamard.next_pow2, which would import numpy
    return (padded * bits + 16) / head_dim


KV_FORMATS: dict[str, KVFormat] = {k.name: k for k in [
    KVFormat("f32", 32.0, "f32", 0.0, LOSSLESS, "F32"),  # the torch runner on a CPU: KV in its f32 activations
    KVFormat("bf16", 16.0, "bf16", 0.0, LOSSLESS, "BF16"),
    KVFormat("f16", 16.0, "f16", 0.0, LOSSLESS, "F16"),
    KVFormat("fp8", 8.0, "fp8", 1.0, NEAR, "FP8 (E4M3)", 0.0005),
    KVFormat("nvfp4", 4.5, "fp4", 2.0, GOOD, "NVFP4", 0.004),
    KVFormat("q8_0", 8.5, "int8", 1.5, NEAR, "Q8_0", 0.0003, "gguf"),
    KVFormat("q4_0", 4.5, "int8", 2.0, GOOD, "Q4_0", 0.01, "gguf"),
    KVFormat("tq4", 4.125, "f16", 6.0, NEAR, "TurboQuant-style 4-bit", 0.002, "turboquant", code_bits=4),
    KVFormat("tq3", 3.125, "f16", 6.0, GOOD, "TurboQuant-style 3-bit", 0.008, "turboquant", code_bits=3),
]}


def mix(name: str) -> Mix:
    if "+embed" in name.lower():  # e.g. q4_k_m+embed_q5_0
        base, _, fmt = name.lower().partition("+embed")
        return with_embed(mix(base), fmt.lstrip("_-"))
    key = name.lower().replace("-", "_") if name.lower() not in MIXES else name.lower()
    key = key if key in MIXES else key.replace("_", "-")
    if key not in MIXES:
        raise PlanError(f"unknown weight format {name!r}; known: {', '.join(sorted(MIXES))}")
    return MIXES[key]


def kv_format(name: str) -> KVFormat:
    if name.lower() not in KV_FORMATS:
        raise PlanError(f"unknown KV-cache format {name!r}; known: {', '.join(KV_FORMATS)}")
    return KV_FORMATS[name.lower()]
