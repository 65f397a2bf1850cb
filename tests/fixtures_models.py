"""Helpers that build tiny models for loader tests: random transformers models from a config, their
canonical weights (an independent mapping, not the loader's tables), GGUF files written the way
llama.cpp's converter writes them, and llama.cpp's own (de)quantizers through ctypes.
"""

from __future__ import annotations

import ctypes
import importlib.util
from collections.abc import Callable
from functools import cache, lru_cache
from pathlib import Path
from typing import Any

import numpy as np

# -- tiny transformers models ----------------------------------------------------------------------
_COMMON = dict(
    vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)
HF_CONFIGS: dict[str, tuple[str, str, dict[str, Any]]] = {
    # arch: (config class, model class, config kwargs)
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(_COMMON, intermediate_size=80, head_dim=16)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(_COMMON, intermediate_size=80, sliding_window=32)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(_COMMON, intermediate_size=80, tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(_COMMON, intermediate_size=80, head_dim=32)),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(_COMMON, intermediate_size=80, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
             head_dim=16, norm_topk_prob=True),
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(_COMMON, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2),
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(_COMMON, num_hidden_layers=7, num_key_value_heads=1, intermediate_size=80, head_dim=32,
             sliding_window=16, query_pre_attn_scalar=32),
    ),
}  # fmt: skip


@cache
def hf_model(arch: str) -> Any:
    """A random-weight transformers model of `arch` (cached; do not modify it)."""
    import torch
    import transformers

    config_cls, model_cls, kwargs = HF_CONFIGS[arch]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**kwargs))
    with torch.no_grad():  # random norms, so a missed +1 or a swapped norm shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.5)
    return model.eval()


def state_dict_np(model: Any, dtype: Any = None) -> dict[str, np.ndarray]:
    """The model's state dict as float32 numpy, after rounding to `dtype` (a torch dtype) if given."""
    out = {}
    for k, v in model.state_dict().items():
        v = v.detach()
        if dtype is not None:
            v = v.to(dtype)
        out[k] = v.float().numpy().copy()
    return out


_HF_TO_CANONICAL = {
    "input_layernorm.weight": "attn_norm",
    "post_attention_layernorm.weight": "mlp_norm",
    "self_attn.q_proj.weight": "q", "self_attn.k_proj.weight": "k", "self_attn.v_proj.weight": "v",
    "self_attn.o_proj.weight": "o",
    "self_attn.q_proj.bias": "q_bias", "self_attn.k_proj.bias": "k_bias", "self_attn.v_proj.bias": "v_bias",
    "self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm",
    "mlp.gate_proj.weight": "gate", "mlp.up_proj.weight": "up", "mlp.down_proj.weight": "down",
    "mlp.gate.weight": "router", "mlp.experts.down_proj": "experts.down",
}  # fmt: skip
_GEMMA3_TO_CANONICAL = {
    **_HF_TO_CANONICAL,
    "post_attention_layernorm.weight": "post_attn_norm",
    "pre_feedforward_layernorm.weight": "mlp_norm",
    "post_feedforward_layernorm.weight": "post_mlp_norm",
}


def hf_canonical(state: dict[str, np.ndarray], arch: str, tied: bool) -> dict[str, np.ndarray]:
    """transformers 5 in-memory names -> canonical names, written out by hand for the tests."""
    table = _GEMMA3_TO_CANONICAL if arch == "gemma3" else _HF_TO_CANONICAL
    out: dict[str, np.ndarray] = {}
    for key, value in state.items():
        if key == "lm_head.weight":
            if not tied:
                out["lm_head"] = value
            continue
        if key in ("model.embed_tokens.weight", "model.norm.weight"):
            name = "embed" if "embed" in key else "norm"
        else:
            _, _, layer, suffix = key.split(".", 3)
            prefix = f"layers.{layer}."
            if suffix == "mlp.experts.gate_up_proj":  # [E, 2I, C], gate rows first
                half = value.shape[1] // 2
                out[prefix + "experts.gate"], out[prefix + "experts.up"] = value[:, :half], value[:, half:]
                continue
            name = prefix + table[suffix]
        if arch == "gemma3" and name.endswith("norm"):
            value = value + np.float32(1.0)
        out[name] = value
    return out


# -- GGUF files as llama.cpp's converter writes them -----------------------------------------------
GGUF_ARCH_OF = {"llama": "llama", "mixtral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
                "qwen3_moe": "qwen3moe", "gemma3": "gemma3"}  # fmt: skip
_CANONICAL_TO_GGUF = {
    "attn_norm": "attn_norm", "q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output",
    "q_bias": "attn_q.bias", "k_bias": "attn_k.bias", "v_bias": "attn_v.bias",
    "q_norm": "attn_q_norm", "k_norm": "attn_k_norm", "mlp_norm": "ffn_norm",
    "post_attn_norm": "post_attention_norm", "post_mlp_norm": "post_ffw_norm",
    "gate": "ffn_gate", "up": "ffn_up", "down": "ffn_down", "router": "ffn_gate_inp",
    "experts.gate": "ffn_gate_exps", "experts.up": "ffn_up_exps", "experts.down": "ffn_down_exps",
}  # fmt: skip


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py `permute` (HF half-split rope rows -> interleaved)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(canonical: str) -> str:
    top = {"embed": "token_embd", "norm": "output_norm", "lm_head": "output"}
    if canonical in top:
        return top[canonical] + ".weight"
    _, layer, rest = canonical.split(".", 2)
    name = _CANONICAL_TO_GGUF[rest]
    return f"blk.{layer}.{name}" + ("" if name.endswith(".bias") else ".weight")


def write_gguf_like_llamacpp(arch: str, model: Any, path: Path) -> dict[str, np.ndarray]:
    """Write `model` as llama.cpp would (F32, permuted llama Q/K, Gemma norms +1); returns the
    canonical weights the loader should give back."""
    import gguf

    cfg = model.config
    tied = bool(cfg.tie_word_embeddings)
    canonical = hf_canonical(state_dict_np(model), arch, tied)
    g = GGUF_ARCH_OF[arch]
    w = gguf.GGUFWriter(path, g)
    w.add_string("general.name", f"tiny {arch}")
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    for key, value in {
        "context_length": cfg.max_position_embeddings, "embedding_length": cfg.hidden_size,
        "block_count": cfg.num_hidden_layers, "feed_forward_length": cfg.intermediate_size,
        "attention.head_count": heads, "attention.head_count_kv": kv_heads,
        "attention.key_length": head_dim, "attention.value_length": head_dim,
    }.items():  # fmt: skip
        w.add_uint32(f"{g}.{key}", int(value))
    w.add_float32(f"{g}.attention.layer_norm_rms_epsilon", float(cfg.rms_norm_eps))
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)
    w.add_float32(f"{g}.rope.freq_base", float(rope["rope_theta"]))
    if arch in ("mixtral", "qwen3_moe"):
        w.add_uint32(
            f"{g}.expert_count", int(cfg.num_experts if arch == "qwen3_moe" else cfg.num_local_experts)
        )
        w.add_uint32(f"{g}.expert_used_count", int(cfg.num_experts_per_tok))
    if arch == "qwen3_moe":
        w.add_uint32(f"{g}.expert_feed_forward_length", int(cfg.moe_intermediate_size))
    if arch == "gemma3":
        w.add_uint32(f"{g}.attention.sliding_window", int(cfg.sliding_window))
    for name, value in canonical.items():
        stored = value
        if g == "llama" and name.split(".")[-1] in ("q", "k"):
            stored = llamacpp_permute(value, heads if name.endswith("q") else kv_heads)
        w.add_tensor(gguf_name(name), np.ascontiguousarray(stored, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return canonical


# -- llama.cpp's reference (de)quantizers through ctypes -------------------------------------------
@lru_cache(maxsize=1)
def ggml_base() -> ctypes.CDLL | None:
    """llama-cpp-python's libggml-base, or None when llama-cpp-python is not installed."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        return None
    libs = sorted((Path(spec.origin).parent / "lib").glob("libggml-base.*"))
    return ctypes.CDLL(str(libs[0])) if libs else None


def _row_fn(lib: ctypes.CDLL, name: str) -> Callable[..., None]:
    fn = getattr(lib, name)
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    return fn  # type: ignore[no-any-return]


def ggml_quantize(values: np.ndarray, type_name: str) -> np.ndarray:
    """llama.cpp's reference quantizer: float32 [rows, n] -> uint8 [rows, bytes per row]."""
    import gguf

    lib = ggml_base()
    assert lib is not None
    qtype = gguf.GGMLQuantizationType[type_name]
    rows, n = values.shape
    src = np.ascontiguousarray(values, dtype=np.float32)
    nbytes = gguf.quant_shape_to_byte_shape((rows, n), qtype)[-1]
    dst = np.zeros((rows, nbytes), dtype=np.uint8)
    name = {"F16": "ggml_fp32_to_fp16_row", "BF16": "ggml_fp32_to_bf16_row_ref"}.get(
        type_name, f"quantize_row_{type_name.lower().replace('_k', '_K')}_ref"
    )
    _row_fn(lib, name)(src.ctypes.data, dst.ctypes.data, src.size)
    return dst


def ggml_dequantize(raw: np.ndarray, type_name: str, shape: tuple[int, ...]) -> np.ndarray:
    """llama.cpp's dequantizer: the stored bytes of a tensor -> float32 of `shape`."""
    lib = ggml_base()
    assert lib is not None
    src = np.ascontiguousarray(raw, dtype=np.uint8)
    dst = np.zeros(shape, dtype=np.float32)
    if type_name == "F32":
        return src.view(np.float32).reshape(shape).copy()
    name = {"F16": "ggml_fp16_to_fp32_row", "BF16": "ggml_bf16_to_fp32_row"}.get(
        type_name, f"dequantize_row_{type_name.lower().replace('_k', '_K')}"
    )
    _row_fn(lib, name)(src.ctypes.data, dst.ctypes.data, dst.size)
    return dst


def random_causal_lm(prefix: str, config: dict[str, Any]) -> Any:
    """transformers' `<prefix>ForCausalLM` with seeded random weights scaled for O(1) logits: norms
    near 1, biases, attention sinks and router score biases non-zero (they all change the output)."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = getattr(transformers, prefix + "ForCausalLM")(getattr(transformers, prefix + "Config")(**config)).eval()
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if "norm" in name:
                p.normal_(1.0, 0.1)
            elif name.endswith(("bias", "sinks")):
                p.normal_(0.0, 0.5 if name.endswith(("sinks", "e_score_correction_bias")) else 0.1)
            elif "embed_tokens" in name:
                p.normal_(0.0, 0.5)
            elif p.is_floating_point() and p.dim() >= 2:
                p.normal_(0.0, 0.15)
    return model
