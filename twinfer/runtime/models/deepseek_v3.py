"""DeepSeek-V3 / R1 and Kimi K2 (`deepseek_v3`, `kimi_k2`): multi-head latent attention (MLA) and
DeepSeek-MoE; `kv_b` is absorbed so attention runs over the cached latents. Checkpoint and GGUF
(`deepseek2`) conventions: docs/models.md, "DeepSeek-V3"."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from twinfer.runtime.errors import UnsupportedArchitecture
from twinfer.runtime.loaders.names import NameTable, rule
from twinfer.runtime.loaders.weights import Shape, Transform
from twinfer.runtime.models.arch import Architecture, Fields
from twinfer.runtime.models.base import Shapes, Weights
from twinfer.runtime.models.common import GGUF_COMMON, HF_COMMON, L
from twinfer.runtime.models.glm4_moe import hf_skip
from twinfer.runtime.models.shared_experts import (
    GGUF_MOE_RULES,
    HF_MOE_RULES,
    SharedExpertsDecoder,
    moe_from_config,
    moe_from_gguf,
)
from twinfer.runtime.ops import Array, Ops, StepContext
from twinfer.runtime.rope import yarn_mscale
from twinfer.runtime.spec import MLASpec, ModelSpec

if TYPE_CHECKING:
    from twinfer.runtime.loaders.gguf_file import GGUFKeys

INTERLEAVED = "rope_interleave"  # a spec.extra key: the checkpoint's rope pairs are interleaved
LATENT_EPS = "latent_norm_eps"  # a spec.extra key: the q/kv latent norms' epsilon (transformers: 1e-6)


class Model(SharedExpertsDecoder):
    def attention_shapes(self, p: str) -> Shapes:
        s, m = self.spec, _mla(self.spec)
        C, H, R, P = s.hidden_size, s.num_heads, m.kv_lora_rank, m.qk_rope_head_dim
        qk = m.qk_nope_head_dim + P
        out: Shapes = {}
        if m.q_lora_rank:
            out |= {p + "q_a": (m.q_lora_rank, C), p + "q_a_norm": (m.q_lora_rank,), p + "q_b": (H * qk, m.q_lora_rank)}
        else:
            out[p + "q"] = (H * qk, C)
        out |= {p + "kv_a": (R + P, C), p + "kv_a_norm": (R,), p + "kv_b_k": (H, R, m.qk_nope_head_dim),
                p + "kv_b_v": (H, m.v_head_dim, R), p + "o": (C, H * m.v_head_dim)}
        if s.attention_bias:
            out |= {p + "kv_a_bias": (R + P,), p + "o_bias": (C,)}
            if m.q_lora_rank:
                out[p + "q_a_bias"] = (m.q_lora_rank,)
        return out

    def attention(self, ops: Ops, w: Weights, p: str, layer: int, h: Array, ctx: StepContext) -> Array:
        s, m = self.spec, _mla(self.spec)
        T, H, R, nope = h.shape[0], s.num_heads, m.kv_lora_rank, m.qk_nope_head_dim
        eps = dict(s.extra).get(LATENT_EPS, s.rms_norm_eps)
        q_low = None
        if m.q_lora_rank:
            q_low = ops.rms_norm(ops.linear(h, w[p + "q_a"], w.get(p + "q_a_bias")), w[p + "q_a_norm"], eps)
            q = ops.linear(q_low, w[p + "q_b"])
        else:
            q = ops.linear(h, w[p + "q"])
        q = q.reshape(T, H, nope + m.qk_rope_head_dim)
        q_rope = ops.rope(q[..., nope:], ctx, layer)  # [T, H, P]
        q_latent = ops.head_linear(q[..., :nope], w[p + "kv_b_k"])  # [T, H, R]
        kv = ops.linear(h, w[p + "kv_a"], w.get(p + "kv_a_bias"))  # [T, R + P]
        latent = ops.rms_norm(kv[..., :R], w[p + "kv_a_norm"], eps)  # [T, R]
        k_rope = ops.rope(kv[..., R:].reshape(T, 1, m.qk_rope_head_dim), ctx, layer)  # [T, 1, P]
        selection = self.select(ops, w, p, layer, h, q_low, ctx)
        o = ops.latent_attention(q_latent, q_rope, latent, k_rope.reshape(T, m.qk_rope_head_dim), ctx, layer,
                                 selection=selection)
        o = ops.head_linear(o, w[p + "kv_b_v"])  # [T, H, V]
        return ops.linear(o.reshape(T, H * m.v_head_dim), w[p + "o"], w.get(p + "o_bias"))

    def select(self, ops: Ops, w: Weights, p: str, layer: int, h: Array, q_low: Array | None,
               ctx: StepContext) -> int | None:
        """The layer whose sparse-attention choice of tokens this layer attends to (`Ops.indexer_topk`),
        from the layer's input h and its query latent q_low; None: every token (dense MLA)."""
        return None


def _mla(spec: ModelSpec) -> MLASpec:
    assert spec.mla is not None, "deepseek_v3 specs carry an MLASpec"
    return spec.mla


def _deinterleave(rows: int, start: int, length: int) -> np.ndarray:
    """Row order that moves the interleaved rope pairs of each block [start, start + length) of
    `rows` rows to half-split order: x0, x2, ..., x1, x3, ..."""
    order = np.arange(rows)
    rope = order[start : start + length]
    order[start : start + length] = np.concatenate((rope[0::2], rope[1::2]))
    return order


def _rope_rows(part: str) -> Transform:
    """Permute the rope rows of `q`/`q_b` (every head's last P rows) or `kv_a` (its last P rows)."""

    def apply(a: list[np.ndarray], spec: ModelSpec) -> np.ndarray:
        w, m = a[0], _mla(spec)
        if not dict(spec.extra).get(INTERLEAVED, True):
            return w
        P = m.qk_rope_head_dim
        if part == "kv":
            return w[_deinterleave(w.shape[0], m.kv_lora_rank, P)]
        per_head = m.qk_nope_head_dim + P
        heads = w.reshape(spec.num_heads, per_head, *w.shape[1:])
        return heads[:, _deinterleave(per_head, m.qk_nope_head_dim, P)].reshape(w.shape)

    return Transform(apply, lambda s, spec: s[0])


def _kv_b(part: str) -> Transform:
    """`kv_b_proj` [H * (nope + V), R] -> the absorbed key part [H, R, nope] or value part [H, V, R]."""

    def split(spec: ModelSpec) -> tuple[int, int, int]:
        m = _mla(spec)
        return m.qk_nope_head_dim, m.v_head_dim, m.kv_lora_rank

    def apply(a: list[np.ndarray], spec: ModelSpec) -> np.ndarray:
        nope, v, R = split(spec)
        heads = a[0].reshape(spec.num_heads, nope + v, R)
        return heads[:, :nope].transpose(0, 2, 1) if part == "k" else heads[:, nope:]

    def shape(s: list[Shape], spec: ModelSpec) -> Shape:
        nope, v, R = split(spec)
        return (s[0][0] // (nope + v), R, nope) if part == "k" else (s[0][0] // (nope + v), v, R)

    return Transform(apply, shape, split=2)  # both parts come from one stored tensor: half its bytes each


_A = L + "self_attn."
HF_NAMES = NameTable(
    "deepseek_v3",
    tuple(r for r in HF_COMMON if "self_attn" not in r.source) + HF_MOE_RULES + (
        rule(_A + "q_proj.weight", "layers.{i}.q", "rope_rows_q"),
        rule(_A + "q_a_proj.weight", "layers.{i}.q_a"),
        rule(_A + "q_a_proj.bias", "layers.{i}.q_a_bias"),
        rule(_A + "q_a_layernorm.weight", "layers.{i}.q_a_norm"),
        rule(_A + "q_b_proj.weight", "layers.{i}.q_b", "rope_rows_q"),
        rule(_A + "kv_a_proj_with_mqa.weight", "layers.{i}.kv_a", "rope_rows_kv"),
        rule(_A + "kv_a_proj_with_mqa.bias", "layers.{i}.kv_a_bias", "rope_rows_kv"),
        rule(_A + "kv_a_layernorm.weight", "layers.{i}.kv_a_norm"),
        rule(_A + "kv_b_proj.weight", "layers.{i}.kv_b_k", "kv_b_k"),
        rule(_A + "kv_b_proj.weight", "layers.{i}.kv_b_v", "kv_b_v"),
        rule(_A + "o_proj.weight", "layers.{i}.o"),
        rule(_A + "o_proj.bias", "layers.{i}.o_bias"),
        rule(_A + "rotary_emb.inv_freq", None),
    ),
    transforms=(("rope_rows_q", _rope_rows("q")), ("rope_rows_kv", _rope_rows("kv")),
                ("kv_b_k", _kv_b("k")), ("kv_b_v", _kv_b("v"))),
)

_B = "blk.{i}."
GGUF_NAMES = NameTable(
    "deepseek2 GGUF",
    tuple(r for r in GGUF_COMMON if ".attn_v." not in r.source and ".attn_output." not in r.source) + GGUF_MOE_RULES + (
        rule(_B + "attn_q.weight", "layers.{i}.q", "rope_rows_q"),
        rule(_B + "attn_q_a.weight", "layers.{i}.q_a"),
        rule(_B + "attn_q_a_norm.weight", "layers.{i}.q_a_norm"),
        rule(_B + "attn_q_b.weight", "layers.{i}.q_b", "rope_rows_q"),
        rule(_B + "attn_kv_a_mqa.weight", "layers.{i}.kv_a", "rope_rows_kv"),
        rule(_B + "attn_kv_a_norm.weight", "layers.{i}.kv_a_norm"),
        rule(_B + "attn_k_b.weight", "layers.{i}.kv_b_k"),
        rule(_B + "attn_v_b.weight", "layers.{i}.kv_b_v"),
        rule(_B + "attn_kv_b.weight", "layers.{i}.kv_b_k", "kv_b_k"),
        rule(_B + "attn_kv_b.weight", "layers.{i}.kv_b_v", "kv_b_v"),
        rule(_B + "attn_output.weight", "layers.{i}.o"),
    ),
    transforms=HF_NAMES.transforms,
)


UNSUPPORTED = {  # config keys of features twinfer does not run yet, with what they are
    "index_topk": "DeepSeek sparse attention's indexer",
    "index_n_heads": "DeepSeek sparse attention's indexer",
    "index_head_dim": "DeepSeek sparse attention's indexer",
}


def hf_spec(c: dict[str, Any], fields: Fields) -> Fields:
    for key, what in UNSUPPORTED.items():
        if c.get(key):
            raise UnsupportedArchitecture(f"config.json sets {key!r} ({what}), which twinfer does not run yet")
    return mla_fields(c, fields)


def mla_fields(c: dict[str, Any], fields: Fields) -> Fields:
    """`hf_spec` less the refusal of sparse attention's keys: MLA, experts and routing (deepseek_v32 adds DSA)."""
    for key, want in (("topk_method", "noaux_tc"), ("scoring_func", "sigmoid")):
        if c.get(key, want) != want:
            raise UnsupportedArchitecture(f"config.json {key}={c[key]!r}: twinfer runs DeepSeek-V3 routing ({want!r})")
    q_lora = c.get("q_lora_rank")
    mla = MLASpec(kv_lora_rank=int(c["kv_lora_rank"]), q_lora_rank=int(q_lora) if q_lora else None,
                  qk_rope_head_dim=int(c["qk_rope_head_dim"]), qk_nope_head_dim=int(c["qk_nope_head_dim"]),
                  v_head_dim=int(c["v_head_dim"]))
    qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    scale = qk**-0.5
    scaling = dict(fields["rope_scaling"] or ())
    if scaling and scaling.get("mscale_all_dim"):  # YaRN's mscale enters the softmax scale squared
        scale *= yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"])) ** 2
    return fields | dict(
        head_dim=qk, num_kv_heads=fields["num_heads"], mla=mla, moe=moe_from_config(c), softmax_scale=scale,
        extra=((INTERLEAVED, bool(c.get("rope_interleave", True))), (LATENT_EPS, 1e-6)),
    )  # transformers' q/kv latent norms keep their default epsilon whatever rms_norm_eps says


def gguf_spec(k: GGUFKeys, fields: Fields) -> Fields:
    q_lora = k.int("attention.q_lora_rank", 0)
    P = k.int("rope.dimension_count")
    qk = k.int("attention.key_length_mla")
    mla = MLASpec(kv_lora_rank=k.int("attention.kv_lora_rank"), q_lora_rank=q_lora or None, qk_rope_head_dim=P,
                  qk_nope_head_dim=qk - P, v_head_dim=k.int("attention.value_length_mla"))
    scale = qk**-0.5
    scaling = dict(fields["rope_scaling"] or ())
    log_mul = k.float("rope.scaling.yarn_log_multiplier", 0.0)
    if scaling and log_mul:  # the converter writes 0.1 * mscale_all_dim; DeepSeek's mscale equals it
        mscale = log_mul / 0.1
        scaling |= dict(mscale=mscale, mscale_all_dim=mscale)
        scale *= yarn_mscale(float(scaling["factor"]), mscale) ** 2
    return fields | dict(
        head_dim=qk, num_kv_heads=fields["num_heads"], mla=mla, moe=moe_from_gguf(k), softmax_scale=scale,
        rope_scaling=tuple(sorted(scaling.items())) or None, extra=((INTERLEAVED, True),),
    )


ARCH = Architecture(
    name="deepseek_v3",
    model=Model,
    hf_names=HF_NAMES,
    hf_defaults={
        "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
        "num_hidden_layers": 61, "num_attention_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
        "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
        "first_k_dense_replace": 3, "norm_topk_prob": True, "max_position_embeddings": 4096,
    },  # transformers' DeepseekV3Config defaults
    hf_spec=hf_spec,
    hf_skip=hf_skip,
    gguf_names=GGUF_NAMES,
    gguf_spec=gguf_spec,
)
