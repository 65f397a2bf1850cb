"""Gemma 3 (text): interleaved sliding-window and global attention, QK-norm, sandwich norms, scaled
embeddings, GELU(tanh) MLP, tied lm_head. Norm weights are the effective multipliers (the HF table folds
the `1 +` in; llama.cpp's converter already did)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from twinfer.runtime.loaders.names import NameTable, rule
from twinfer.runtime.loaders.weights import elementwise
from twinfer.runtime.models.arch import Architecture, Fields
from twinfer.runtime.models.base import Model as _Decoder
from twinfer.runtime.models.base import Shapes, Weights
from twinfer.runtime.models.common import GGUF_DECODER, GGUF_QK_NORM, L
from twinfer.runtime.ops import Array, Ops, StepContext
from twinfer.runtime.spec import FULL, SLIDING, ModelSpec

if TYPE_CHECKING:
    from twinfer.runtime.vision import VisionTower

SWA_PATTERN = 6  # every 6th layer is global (transformers' default, llama.cpp `set_swa_pattern(6)`)
LOCAL_ROPE_BASE = 10000.0  # llama.cpp: the local layers' rope base


class Model(_Decoder):
    def layer_norm_shapes(self, p: str) -> Shapes:
        C = self.spec.hidden_size
        return {p + n: (C,) for n in ("attn_norm", "post_attn_norm", "mlp_norm", "post_mlp_norm")}

    def block(self, ops: Ops, w: Weights, p: str, layer: int, x: Array, ctx: StepContext) -> Array:
        eps = self.spec.rms_norm_eps
        h = self.attention(ops, w, p, layer, ops.rms_norm(x, w[p + "attn_norm"], eps), ctx)
        x, h = ops.add_rms_norm(x, ops.rms_norm(h, w[p + "post_attn_norm"], eps), w[p + "mlp_norm"], eps)
        h = self.feed_forward(ops, w, p, layer, h)
        return x + ops.rms_norm(h, w[p + "post_mlp_norm"], eps)


PLUS1 = "norm_plus_one"
HF_NAMES = NameTable(
    "gemma3",
    (
        rule("model.embed_tokens.weight", "embed"),
        rule("model.norm.weight", "norm", PLUS1),
        rule("lm_head.weight", "lm_head"),
        rule(L + "input_layernorm.weight", "layers.{i}.attn_norm", PLUS1),
        rule(L + "post_attention_layernorm.weight", "layers.{i}.post_attn_norm", PLUS1),
        rule(L + "pre_feedforward_layernorm.weight", "layers.{i}.mlp_norm", PLUS1),
        rule(L + "post_feedforward_layernorm.weight", "layers.{i}.post_mlp_norm", PLUS1),
        rule(L + "self_attn.q_norm.weight", "layers.{i}.q_norm", PLUS1),
        rule(L + "self_attn.k_norm.weight", "layers.{i}.k_norm", PLUS1),
        *(rule(L + f"self_attn.{p}_proj.weight", "layers.{i}." + p) for p in "qkvo"),
        *(rule(L + f"mlp.{p}_proj.weight", "layers.{i}." + p) for p in ("gate", "up", "down")),
        # Gemma3ForConditionalGeneration checkpoints: the image side is not part of a text model.
        rule("vision_tower.{*}", None),
        rule("multi_modal_projector.{*}", None),
    ),
    aliases=(
        ("model.language_model.", "model."),  # transformers 5
        ("language_model.model.", "model."),  # transformers 4
        ("language_model.lm_head.", "lm_head."),
        ("model.vision_tower.", "vision_tower."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
    ),
    transforms=((PLUS1, elementwise(lambda a: a + np.float32(1.0))),),
)
GGUF_NAMES = GGUF_DECODER.extended("gemma3 GGUF", GGUF_QK_NORM + (
    rule("blk.{i}.post_attention_norm.weight", "layers.{i}.post_attn_norm"),
    rule("blk.{i}.post_ffw_norm.weight", "layers.{i}.post_mlp_norm"),
))


def hf_config(config: dict[str, Any]) -> dict[str, Any]:
    """The text model's keys: a multimodal config nests them in `text_config`."""
    text = config.get("text_config") if config.get("model_type") == "gemma3" else None
    c = dict(text or config)
    if "hidden_activation" in c:  # Gemma's name for hidden_act
        c["hidden_act"] = c["hidden_activation"]
    return c


def hf_spec(c: dict[str, Any], fields: Fields) -> Fields:
    n = fields["num_layers"]
    if not c.get("layer_types"):
        pattern = int(c.get("sliding_window_pattern") or c.get("_sliding_window_pattern") or SWA_PATTERN)
        fields["layer_types"] = tuple(FULL if (i + 1) % pattern == 0 else SLIDING for i in range(n))
    return fields | dict(qk_norm=True, embed_scale=True, query_pre_attn_scalar=float(c["query_pre_attn_scalar"]))


def gguf_spec(k: Any, fields: Fields) -> Fields:
    n, hidden, heads = fields["num_layers"], fields["hidden_size"], fields["num_heads"]
    window = k.int("attention.sliding_window", 0)
    out = fields | dict(hidden_act="gelu_tanh", embed_scale=True)
    # llama.cpp: 27B (62 layers) scales queries by hidden/heads, the others by the head size.
    out["query_pre_attn_scalar"] = float(hidden // heads if n == 62 else fields["head_dim"])
    if window > 0:
        out |= dict(sliding_window=window, rope_local_theta=LOCAL_ROPE_BASE)
        out["layer_types"] = tuple(FULL if i % SWA_PATTERN == SWA_PATTERN - 1 else SLIDING for i in range(n))
        # a per-layer pattern (llama.cpp load_swa_pattern), as pruned files write it: true = sliding
        pattern = k.meta.get("gemma3.attention.sliding_window_pattern")
        if isinstance(pattern, list) and len(pattern) == n:
            out["layer_types"] = tuple(SLIDING if p else FULL for p in pattern)
    return out


# Gemma 3's template (google/gemma-3-*-it tokenizer_config.json). GGUF conversions of Gemma 3 do not
# always carry it (the default model's file does not), and ChatML would be the wrong format for it.
CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""


def open_vision(folder: Path, config: dict[str, Any], spec: ModelSpec, ops: Ops) -> VisionTower | None:
    """The SigLIP tower and projector of a Gemma3ForConditionalGeneration checkpoint (runtime/vision/gemma3.py)."""
    from twinfer.runtime.vision.gemma3 import open_gemma3_vision

    return open_gemma3_vision(folder, config, spec, ops)


ARCH = Architecture(
    name="gemma3",
    model=Model,
    hf_names=HF_NAMES,
    gguf_names=GGUF_NAMES,
    hf_defaults={
        "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
        "max_position_embeddings": 131072, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10000.0,
        "query_pre_attn_scalar": 256, "sliding_window": 4096, "sliding_window_pattern": 6,
        "tie_word_embeddings": True, "hidden_act": "gelu_pytorch_tanh",
    },  # transformers' Gemma3TextConfig defaults (5.x): multimodal configs list only what differs
    hf_config=hf_config,
    hf_spec=hf_spec,
    gguf_spec=gguf_spec,
    chat_template=CHAT_TEMPLATE,
    vision=open_vision,
    image_text=("\n\n", "<image_soft_token>"),
)
