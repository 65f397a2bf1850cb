"""Random-weight checkpoints written tensor by tensor, for tests and benchmarks of large models.

`write_synthetic_moe` writes a Hugging Face qwen3_moe folder (config.json, sharded safetensors with
one tensor per expert, an index), `write_synthetic_gpt_oss` a gpt_oss one (fused experts), of any size with bounded memory: each tensor is drawn from its own
seeded generator, written, and dropped, so a 2 GB model costs one tensor of RAM to make.
`greedy_tokens` decodes a prompt greedily straight through a runner (no tokenizer needed).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from twinfer.runtime.batch import SeqChunk, StepBatch
from twinfer.runtime.runner import Runner


@dataclass(frozen=True)
class SyntheticMoE:
    """The shape of a synthetic qwen3_moe model."""

    hidden: int = 256
    intermediate: int = 256  # per expert
    layers: int = 16
    experts: int = 16
    top_k: int = 4
    vocab: int = 512
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    dtype: str = "F32"  # "F32" or "BF16" in the file

    @property
    def expert_bytes(self) -> int:
        """Stored bytes of every routed expert in the model."""
        item = 4 if self.dtype == "F32" else 2
        return self.layers * self.experts * 3 * self.intermediate * self.hidden * item

    def config(self) -> dict[str, object]:
        return {
            "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": self.vocab,
            "hidden_size": self.hidden, "intermediate_size": 4 * self.hidden, "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads, "num_key_value_heads": self.kv_heads, "head_dim": self.head_dim,
            "moe_intermediate_size": self.intermediate, "num_experts": self.experts,
            "num_experts_per_tok": self.top_k, "norm_topk_prob": True, "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
            "torch_dtype": "float32" if self.dtype == "F32" else "bfloat16",
        }  # fmt: skip

    def layer_tensors(self, i: int) -> Iterator[tuple[str, tuple[int, ...], float]]:
        """(name, shape, std) of layer i's tensors; std 0 marks a norm (ones plus noise)."""
        C, Ie, D = self.hidden, self.intermediate, self.head_dim
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (C,), 0.0
        yield p + "post_attention_layernorm.weight", (C,), 0.0
        yield p + "self_attn.q_proj.weight", (self.heads * D, C), C**-0.5
        yield p + "self_attn.k_proj.weight", (self.kv_heads * D, C), C**-0.5
        yield p + "self_attn.v_proj.weight", (self.kv_heads * D, C), C**-0.5
        yield p + "self_attn.o_proj.weight", (C, self.heads * D), (self.heads * D) ** -0.5
        yield p + "self_attn.q_norm.weight", (D,), 0.0
        yield p + "self_attn.k_norm.weight", (D,), 0.0
        yield p + "mlp.gate.weight", (self.experts, C), 4 * C**-0.5  # sharp routing: experts differ
        for e in range(self.experts):
            for proj, shape in (("gate", (Ie, C)), ("up", (Ie, C)), ("down", (C, Ie))):
                yield p + f"mlp.experts.{e}.{proj}_proj.weight", shape, shape[1] ** -0.5


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


def _values(shape: tuple[int, ...], std: float, seed: int, index: int, dtype: str) -> np.ndarray:
    rng = np.random.default_rng([seed, index])
    if std == 0.0:
        x = 1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)
    else:
        x = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
    if dtype == "BF16":  # round to nearest even, keep the top half
        bits = x.view(np.uint32)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return x


def _write_shard(path: Path, tensors: list[tuple[str, tuple[int, ...], float, int]], seed: int, dtype: str) -> None:
    item = 4 if dtype == "F32" else 2
    header: dict[str, object] = {}
    offset = 0
    for name, shape, _, _ in tensors:
        size = int(np.prod(shape)) * item
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _, shape, std, index in tensors:
            f.write(_values(shape, std, seed, index, dtype).tobytes())


def write_synthetic_moe(folder: Path, shape: SyntheticMoE | SyntheticGptOss = SyntheticMoE(), seed: int = 0) -> Path:
    """Write a random qwen3_moe (or, given a `SyntheticGptOss`, gpt_oss) checkpoint into `folder`
    (one shard per layer); returns the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(shape.config(), indent=1))
    C, V = shape.hidden, shape.vocab
    shards: list[list[tuple[str, tuple[int, ...], float]]] = [
        [("model.embed_tokens.weight", (V, C), 1.0), ("model.norm.weight", (C,), 0.0),
         ("lm_head.weight", (V, C), 4 * C**-0.5)]
    ]
    shards += [list(shape.layer_tensors(i)) for i in range(shape.layers)]
    weight_map: dict[str, str] = {}
    index = 0
    for k, tensors in enumerate(shards):
        name = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        numbered = []
        for t in tensors:
            numbered.append((*t, index))
            weight_map[t[0]] = name
            index += 1
        _write_shard(folder / name, numbered, seed, shape.dtype)
    index_json = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index_json))
    return folder


def write_synthetic_gpt_oss(folder: Path, shape: SyntheticGptOss = SyntheticGptOss(), seed: int = 0) -> Path:
    """Write a random gpt_oss checkpoint into `folder` (one shard per layer); returns the folder."""
    return write_synthetic_moe(folder, shape, seed)


def greedy_tokens(runner: Runner, prompt: list[int], steps: int, seq_id: int = 1) -> list[int]:
    """Prefill `prompt`, then decode `steps` tokens greedily; returns the generated ids."""
    bs = runner.kv.block_size
    total = len(prompt) + steps
    table = list(range(-(-total // bs)))
    out: list[int] = []
    chunk = SeqChunk(seq_id, list(prompt), 0, table)
    for _ in range(steps):
        logits = runner.step(StepBatch([chunk]))
        nxt = int(np.argmax(logits[-1]))
        out.append(nxt)
        chunk = SeqChunk(seq_id, [nxt], chunk.end, table)
    runner.release(seq_id)
    return out
