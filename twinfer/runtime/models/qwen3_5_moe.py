"""Qwen3.5 MoE (the text model): Qwen3-Next's hybrid layers, with the linear projections stored apart,
always-renormalized routing and a multimodal checkpoint whose text model alone is read
(docs/models.md, "Qwen3.5 MoE")."""

from __future__ import annotations

from typing import Any

import numpy as np

from twinfer.runtime.loaders.names import NameTable, rule
from twinfer.runtime.loaders.weights import Transform
from twinfer.runtime.models import qwen3_next
from twinfer.runtime.models.arch import Architecture, Fields
from twinfer.runtime.models.qwen3_next import BLK, LIN, TRANSFORMS, _la
from twinfer.runtime.spec import ModelSpec


class Model(qwen3_next.Model):
    pass


HF_NAMES = NameTable("qwen3_5_moe", qwen3_next.HF_RULES + (
    rule(LIN + "in_proj_qkv.weight", "layers.{i}.lin.qkv"),
    rule(LIN + "in_proj_z.weight", "layers.{i}.lin.z"),
    rule(LIN + "in_proj_b.weight", "layers.{i}.lin.b"),
    rule(LIN + "in_proj_a.weight", "layers.{i}.lin.a"),
    rule("model.visual.{*}", None),  # the vision tower is not part of a text model
), aliases=(("model.language_model.", "model."),), transforms=TRANSFORMS)


# -- GGUF: llama.cpp's converter (qwen35moe) orders value heads tiled, [K0, K1, .., K0, K1, ..], where the
# checkpoint groups them by key head, [G0_v0 .. G0_v(r-1), G1_v0, ..]; the table puts them back
def _untile(a: np.ndarray, axis: int, spec: ModelSpec, head: int, skip: int = 0) -> np.ndarray:
    """Value heads of size `head` along `axis` (after `skip` leading entries) from tiled to grouped order."""
    la = _la(spec)
    r, hk = la.num_v_heads // la.num_k_heads, la.num_k_heads
    a = np.moveaxis(a, axis, 0)
    heads = a[skip:].reshape(r, hk, head, *a.shape[1:]).swapaxes(0, 1).reshape(a[skip:].shape)
    return np.moveaxis(np.concatenate([a[:skip], heads]), 0, axis)


def _untiled(axis: int, part: str) -> Transform:
    def apply(a: list[np.ndarray], spec: ModelSpec) -> np.ndarray:
        la = _la(spec)
        head = 1 if part == "head" else la.head_v_dim
        skip = 2 * la.key_dim if part == "qkv" else 0
        return _untile(a[0], axis, spec, head, skip)

    return Transform(apply, lambda s, spec: s[0])


GGUF_NAMES = NameTable("qwen35moe GGUF", qwen3_next.GGUF_RULES + (
    rule(BLK + "attn_qkv.weight", "layers.{i}.lin.qkv", "untile_qkv"),
    rule(BLK + "attn_gate.weight", "layers.{i}.lin.z", "untile_rows"),
    rule(BLK + "ssm_beta.weight", "layers.{i}.lin.b", "untile_heads"),
    rule(BLK + "ssm_alpha.weight", "layers.{i}.lin.a", "untile_heads"),
    rule(BLK + "ssm_conv1d.weight", "layers.{i}.lin.conv", "untile_qkv"),
    rule(BLK + "ssm_dt.bias", "layers.{i}.lin.dt_bias", "untile_heads"),
    rule(BLK + "ssm_a", "layers.{i}.lin.decay", "untile_heads"),
    rule(BLK + "ssm_out.weight", "layers.{i}.lin.out", "untile_columns"),
), transforms=TRANSFORMS + (
    ("untile_qkv", _untiled(0, "qkv")), ("untile_rows", _untiled(0, "v")), ("untile_heads", _untiled(0, "head")),
    ("untile_columns", _untiled(1, "v")),
))


def hf_config(config: dict[str, Any]) -> dict[str, Any]:
    """The text model's keys: the multimodal config nests them in `text_config`."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else None
    return dict(text or config)


def hf_spec(c: dict[str, Any], fields: Fields) -> Fields:
    c = {**c, "norm_topk_prob": True}  # Qwen3.5's router always renormalizes its top k
    out = qwen3_next.hf_spec(c, fields)
    if not c.get("intermediate_size") and out["moe"] is not None:  # no dense MLP: the shared expert's width
        out["intermediate_size"] = out["moe"].shared_intermediate_size
    return out


ARCH = Architecture(
    name="qwen3_5_moe",
    model=Model,
    hf_names=HF_NAMES,
    hf_defaults={**qwen3_next.HF_DEFAULTS, "vocab_size": 248320, "max_position_embeddings": 262144,
                 "intermediate_size": 0},
    hf_config=hf_config,
    hf_spec=hf_spec,
    hf_skip=qwen3_next.hf_skip,
    gguf_names=GGUF_NAMES,
    gguf_spec=qwen3_next.gguf_spec,
)
