"""A synthetic gpt-oss checkpoint of any size, for the streaming tests (runtime/synthetic.py writes it).

Test-only: nothing outside tests/ builds one, so it lives here rather than in the architecture's file.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class SyntheticGptOss:
    """The shape of a synthetic gpt_oss model: sinks, alternating sliding and full layers, a biased
    router, biased experts with a clamped SwiGLU, stored as transformers holds them (fused
    `gate_up_proj` [E, C, 2I] with gate and up interleaved, `down_proj` [E, I, C])."""

    hidden: int = 1024
    intermediate: int = 512  # per expert
    layers: int = 12
    experts: int = 32
    top_k: int = 4
    vocab: int = 512
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 64
    sliding_window: int = 128
    dtype: str = "F32"

    @property
    def expert_bytes(self) -> int:
        """Stored bytes of every routed expert in the model (biases excluded)."""
        item = 4 if self.dtype == "F32" else 2
        return self.layers * self.experts * 3 * self.intermediate * self.hidden * item

    def config(self) -> dict[str, object]:
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(self.layers)]
        return {
            "model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "vocab_size": self.vocab,
            "hidden_size": self.hidden, "intermediate_size": self.intermediate, "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads, "num_key_value_heads": self.kv_heads, "head_dim": self.head_dim,
            "num_local_experts": self.experts, "num_experts_per_tok": self.top_k, "sliding_window": self.sliding_window,
            "layer_types": types, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "attention_bias": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 150000.0}, "swiglu_limit": 7.0,
            "tie_word_embeddings": False, "torch_dtype": "float32" if self.dtype == "F32" else "bfloat16",
        }  # fmt: skip

    def layer_tensors(self, i: int) -> Iterator[tuple[str, tuple[int, ...], float]]:
        """(name, shape, std) of layer i's tensors; std 0 marks a norm (ones plus noise)."""
        C, Ie, D, E, H, Hkv = self.hidden, self.intermediate, self.head_dim, self.experts, self.heads, self.kv_heads
        p, a, x = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp.experts."
        yield p + "input_layernorm.weight", (C,), 0.0
        yield p + "post_attention_layernorm.weight", (C,), 0.0
        for proj, rows in (("q", H * D), ("k", Hkv * D), ("v", Hkv * D)):
            yield a + f"{proj}_proj.weight", (rows, C), C**-0.5
            yield a + f"{proj}_proj.bias", (rows,), 0.1
        yield a + "o_proj.weight", (C, H * D), (H * D) ** -0.5
        yield a + "o_proj.bias", (C,), 0.1
        yield a + "sinks", (H,), 0.5
        yield p + "mlp.router.weight", (E, C), 4 * C**-0.5  # sharp routing: experts differ
        yield p + "mlp.router.bias", (E,), 0.5
        yield x + "gate_up_proj", (E, C, 2 * Ie), C**-0.5
        yield x + "gate_up_proj_bias", (E, 2 * Ie), 0.1
        yield x + "down_proj", (E, Ie, C), Ie**-0.5
        yield x + "down_proj_bias", (E, C), 0.1
