"""A random-weight Qwen3-MoE as a BF16 GGUF written by llama.cpp's own converter, at any size.

Used by the memory-budget test (a ~75 MB model) and bench/bench_budget.py (the 1.65 GB one: 16 layers,
64 experts top-4). Weights are drawn from seed 0; the tokenizer is gguf_convert's tiny byte-level BPE.
"""

from __future__ import annotations

from pathlib import Path

SHAPES = {
    # routed experts are 97% of the bytes, as in the MoEs people page from disk
    "tiny": dict(hidden_size=256, moe_intermediate_size=192, num_hidden_layers=8, num_experts=32,
                 num_experts_per_tok=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64),
    "1.6gb": dict(hidden_size=1024, moe_intermediate_size=256, num_hidden_layers=16, num_experts=64,
                  num_experts_per_tok=4, num_attention_heads=8, num_key_value_heads=2, head_dim=64),
}  # fmt: skip


def write_qwen3_moe_gguf(folder: Path, shape: str = "tiny") -> Path:
    """`folder`/qwen3moe-`shape`-bf16.gguf (made once: an existing file is returned as it is)."""
    out = folder / f"qwen3moe-{shape}-bf16.gguf"
    if out.is_file():
        return out
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from tests.gguf_convert import TINY_VOCAB, convert, save_tiny_tokenizer

    hf = folder / f"qwen3moe-{shape}-hf"
    cfg = Qwen3MoeConfig(vocab_size=TINY_VOCAB, intermediate_size=512, max_position_embeddings=8192,
                         norm_topk_prob=True, tie_word_embeddings=False, initializer_range=0.1,
                         **SHAPES[shape])  # wider than 0.02: greedy text that varies
    torch.manual_seed(0)
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # build in BF16: the 1.6 GB model is never held in float32
    try:
        model = Qwen3MoeForCausalLM(cfg)
    finally:
        torch.set_default_dtype(dtype)
    model.save_pretrained(hf)
    del model
    save_tiny_tokenizer(hf, "deepseek")
    convert(hf, out, outtype="bf16")
    return out
