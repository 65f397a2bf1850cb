"""A random-weight Qwen3-MoE GGUF written straight by gguf-py, tensor by tensor, at any size.

No converter, no torch, no network (what a bare GPU machine has): every matrix is Q8_0 blocks of random
int8 values under one small scale, cut from one 8 MiB pool of random blocks (a bigger model repeats
them: every weight is still read and multiplied), so a 10 GB file costs one tensor of memory and
seconds a GB. The vocabulary is 256 byte tokens and three controls (SentencePiece-style, as
llama.cpp reads any architecture's). Used by tests/test_placement.py (a few MB) and by
bench/gpu_placement.py (a model bigger than the memory budget it runs in).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

Q8_BLOCK, Q8_BYTES = 32, 34  # 32 int8 values and an f16 scale


@dataclass(frozen=True)
class MoEShape:
    hidden: int = 64
    expert_ffn: int = 32  # per expert
    layers: int = 4
    experts: int = 8
    top_k: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    vocab: int = 259  # 3 controls + 256 bytes
    context: int = 4096

    def tensors(self) -> Iterator[tuple[str, tuple[int, ...], str]]:
        """(GGUF name, numpy shape, "q8_0" | "f32") in file order."""
        h, q, kv, e, f = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.experts, self.expert_ffn
        yield "token_embd.weight", (self.vocab, h), "q8_0"
        for i in range(self.layers):
            b = f"blk.{i}"
            yield f"{b}.attn_norm.weight", (h,), "f32"
            yield f"{b}.attn_q.weight", (q, h), "q8_0"
            yield f"{b}.attn_k.weight", (kv, h), "q8_0"
            yield f"{b}.attn_v.weight", (kv, h), "q8_0"
            yield f"{b}.attn_output.weight", (h, q), "q8_0"
            yield f"{b}.attn_q_norm.weight", (self.head_dim,), "f32"
            yield f"{b}.attn_k_norm.weight", (self.head_dim,), "f32"
            yield f"{b}.ffn_norm.weight", (h,), "f32"
            yield f"{b}.ffn_gate_inp.weight", (e, h), "f32"
            yield f"{b}.ffn_gate_exps.weight", (e, f, h), "q8_0"
            yield f"{b}.ffn_up_exps.weight", (e, f, h), "q8_0"
            yield f"{b}.ffn_down_exps.weight", (e, h, f), "q8_0"
        yield "output_norm.weight", (h,), "f32"
        yield "output.weight", (self.vocab, h), "q8_0"

    @property
    def nbytes(self) -> int:
        return sum(_nbytes(shape, kind) for _, shape, kind in self.tensors())


def _nbytes(shape: tuple[int, ...], kind: str) -> int:
    n = int(np.prod(shape))
    return n // Q8_BLOCK * Q8_BYTES if kind == "q8_0" else n * 4


def _values(shape: tuple[int, ...], kind: str, rng: np.random.Generator, pool: np.ndarray) -> np.ndarray:
    if kind == "f32":  # norms at 1, the router small
        return (1.0 + 0.02 * rng.standard_normal(shape)).astype(np.float32)
    n = int(np.prod(shape[:-1])) * (shape[-1] // Q8_BLOCK)
    blocks = np.resize(pool, (n, Q8_BYTES))  # the pool's blocks over and over: a GB a second, not 0.2
    return blocks.view(np.uint8).reshape(*shape[:-1], shape[-1] // Q8_BLOCK * Q8_BYTES)


def _pool(rng: np.random.Generator, nbytes: int = 1 << 23) -> np.ndarray:
    """Random Q8_0 blocks (8 MiB: every tensor of a small model is wholly random) under one small scale."""
    blocks = np.frombuffer(rng.bytes(nbytes // Q8_BYTES * Q8_BYTES), np.int8).reshape(-1, Q8_BYTES).copy()
    blocks[:, :2] = np.frombuffer(np.float16(0.02 / 127).tobytes(), np.int8)
    return blocks


def write_random_moe_gguf(path: Path, shape: MoEShape = MoEShape(), seed: int = 0) -> Path:
    """Write `shape` to `path` (an existing file of the right size is kept) and return it."""
    import gguf

    if path.is_file() and path.stat().st_size >= shape.nbytes:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    _metadata(w, shape)
    for name, dims, kind in shape.tensors():
        if kind == "q8_0":  # given as bytes: gguf-py turns the byte shape back into the values'
            w.add_tensor_info(name, (*dims[:-1], dims[-1] // Q8_BLOCK * Q8_BYTES), np.dtype(np.uint8),
                              _nbytes(dims, kind), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor_info(name, dims, np.dtype(np.float32), _nbytes(dims, kind))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    pool = _pool(rng)
    for _, dims, kind in shape.tensors():
        w.write_tensor_data(_values(dims, kind, rng, pool))
    w.close()
    return path


def _metadata(w: object, s: MoEShape) -> None:
    import gguf

    assert isinstance(w, gguf.GGUFWriter)
    w.add_name(f"random qwen3moe {s.layers}x{s.experts}")
    w.add_block_count(s.layers)
    w.add_context_length(s.context)
    w.add_embedding_length(s.hidden)
    w.add_feed_forward_length(s.expert_ffn * s.top_k)
    w.add_expert_feed_forward_length(s.expert_ffn)
    w.add_expert_count(s.experts)
    w.add_expert_used_count(s.top_k)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    w.add_tokenizer_model("llama")
    w.add_token_list(["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(s.vocab - 3)])
    w.add_token_scores([0.0] * s.vocab)
    w.add_token_types([2, 3, 3] + [6] * (s.vocab - 3))  # unknown, control, control, then bytes
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
