"""Name rules and config readers shared by the llama-family decoders (llama, mistral, qwen, ...)."""

from __future__ import annotations

from typing import Any

from twinfer.runtime.loaders.names import NameTable, rule
from twinfer.runtime.spec import FULL, SLIDING

GGUF_COMMON = (
    rule("token_embd.weight", "embed"),
    rule("output_norm.weight", "norm"),
    rule("output.weight", "lm_head"),
    rule("blk.{i}.attn_norm.weight", "layers.{i}.attn_norm"),
    rule("blk.{i}.attn_v.weight", "layers.{i}.v"),
    rule("blk.{i}.attn_v.bias", "layers.{i}.v_bias"),
    rule("blk.{i}.attn_output.weight", "layers.{i}.o"),
    rule("blk.{i}.ffn_norm.weight", "layers.{i}.mlp_norm"),
    rule("blk.{i}.ffn_gate.weight", "layers.{i}.gate"),
    rule("blk.{i}.ffn_up.weight", "layers.{i}.up"),
    rule("blk.{i}.ffn_down.weight", "layers.{i}.down"),
)
GGUF_QK = (
    rule("blk.{i}.attn_q.weight", "layers.{i}.q"),
    rule("blk.{i}.attn_k.weight", "layers.{i}.k"),
    rule("blk.{i}.attn_q.bias", "layers.{i}.q_bias"),
    rule("blk.{i}.attn_k.bias", "layers.{i}.k_bias"),
)
GGUF_QK_NORM = (
    rule("blk.{i}.attn_q_norm.weight", "layers.{i}.q_norm"),
    rule("blk.{i}.attn_k_norm.weight", "layers.{i}.k_norm"),
)
GGUF_MOE = (
    rule("blk.{i}.ffn_gate_inp.weight", "layers.{i}.router"),
    rule("blk.{i}.ffn_gate_exps.weight", "layers.{i}.experts.gate"),
    rule("blk.{i}.ffn_up_exps.weight", "layers.{i}.experts.up"),
    rule("blk.{i}.ffn_down_exps.weight", "layers.{i}.experts.down"),
    # GGUF files from before llama.cpp merged experts (2024) keep one tensor per expert.
    rule("blk.{i}.ffn_gate.{e}.weight", "layers.{i}.experts.gate", "stack_experts"),
    rule("blk.{i}.ffn_up.{e}.weight", "layers.{i}.experts.up", "stack_experts"),
    rule("blk.{i}.ffn_down.{e}.weight", "layers.{i}.experts.down", "stack_experts"),
)

L = "model.layers.{i}."
HF_COMMON = (
    rule("model.embed_tokens.weight", "embed"),
    rule("model.norm.weight", "norm"),
    rule("lm_head.weight", "lm_head"),
    rule(L + "input_layernorm.weight", "layers.{i}.attn_norm"),
    rule(L + "post_attention_layernorm.weight", "layers.{i}.mlp_norm"),
    *(rule(L + f"self_attn.{p}_proj.weight", "layers.{i}." + p) for p in "qkvo"),
    *(rule(L + f"self_attn.{p}_proj.bias", f"layers.{{i}}.{p}_bias") for p in "qkv"),
    rule(L + "self_attn.q_norm.weight", "layers.{i}.q_norm"),
    rule(L + "self_attn.k_norm.weight", "layers.{i}.k_norm"),
    *(rule(L + f"mlp.{p}_proj.weight", "layers.{i}." + p) for p in ("gate", "up", "down")),
    rule(L + "self_attn.rotary_emb.inv_freq", None),  # a buffer old checkpoints saved
)
# transformers >= 5 holds experts fused in memory ([E, 2I, C] gate rows then up rows, [E, C, I]).
HF_FUSED_EXPERTS = (
    rule(L + "mlp.gate.weight", "layers.{i}.router"),
    rule(L + "mlp.experts.gate_up_proj", "layers.{i}.experts.gate", "gate_half"),
    rule(L + "mlp.experts.gate_up_proj", "layers.{i}.experts.up", "up_half"),
    rule(L + "mlp.experts.down_proj", "layers.{i}.experts.down"),
)
HF_STACKED_EXPERTS = tuple(  # one tensor per expert, as transformers 4 saved them
    rule(L + f"mlp.experts.{{e}}.{p}_proj.weight", f"layers.{{i}}.experts.{p}", "stack_experts")
    for p in ("gate", "up", "down")
)

HF_DECODER = NameTable("llama-style decoder", HF_COMMON)
GGUF_DECODER = NameTable("llama-style GGUF", GGUF_COMMON + GGUF_QK)


def qwen_layer_types(c: dict[str, Any], n_layers: int) -> tuple[str, ...] | None:
    """Qwen's `use_sliding_window`: layers from `max_window_layers` on slide; None when it is off."""
    if not c.get("use_sliding_window") or not c.get("sliding_window"):
        return None
    first = int(c.get("max_window_layers", 0))
    return tuple(SLIDING if i >= first else FULL for i in range(n_layers))
