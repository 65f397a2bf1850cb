"""Random-weight MoE GGUFs written by llama.cpp's own converter, at any size.

- `write_qwen3_moe_gguf`: a Qwen3-MoE in BF16, used by the memory-budget test (a ~75 MB model) and
  bench/bench_budget.py (the 1.65 GB one: 16 layers, 64 experts top-4), drawn by transformers (seed 0);
- `write_gpt_oss_gguf`: gpt-oss-20b's layer shape (hidden 2880, 32 experts top-4 of FFN 2880, 64 query / 8
  KV heads with sinks, sliding and full layers alternating) for a few layers, its experts MXFP4 as
  published (random E2M1 codes under one block scale), the rest Q8_0 as in ggml-org's files: a checkpoint in
  transformers' GptOss layout (tests/synthetic_gpt_oss.py) written shard by shard, so 1.9 GB costs one
  layer of memory.

The tokenizer is gguf_convert's tiny byte-level BPE. `routing="uniform"` gives either model routers that
spread top-k evenly over tokens (`uniform_routing`): random weights favour a few experts, which flatters a cache.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from tests.synthetic_gpt_oss import SyntheticGptOss

SHAPES = {
    # routed experts are 97% of the bytes, as in the MoEs people page from disk
    "tiny": dict(hidden_size=256, moe_intermediate_size=192, num_hidden_layers=8, num_experts=32,
                 num_experts_per_tok=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64),
    "1.6gb": dict(hidden_size=1024, moe_intermediate_size=256, num_hidden_layers=16, num_experts=64,
                  num_experts_per_tok=4, num_attention_heads=8, num_key_value_heads=2, head_dim=64),
}  # fmt: skip


def write_qwen3_moe_gguf(folder: Path, shape: str = "tiny", routing: str = "random") -> Path:
    """`folder`/qwen3moe-`shape`-bf16.gguf (made once: an existing file is returned as it is)."""
    out = folder / f"qwen3moe-{shape}-bf16.gguf"
    if routing == "uniform":
        return uniform_routing(write_qwen3_moe_gguf(folder, shape), folder / f"qwen3moe-{shape}-uniform-bf16.gguf")
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


# gpt-oss-20b's layer (hidden 2880, 32 experts of 2880, top-4, 64 x 64 query and 8 KV heads, window 128)
GPT_OSS_SHAPES = {"20b-4l": dict(layers=4), "20b-2l": dict(layers=2)}
MXFP4_SCALE = 120  # E8M0 2**-7: random E2M1 codes (RMS 2.93) then have RMS 0.023, about hidden**-0.5


def gpt_oss_shape(shape: str) -> SyntheticGptOss:
    from tests.gguf_convert import TINY_VOCAB
    from tests.synthetic_gpt_oss import SyntheticGptOss

    return SyntheticGptOss(hidden=2880, intermediate=2880, experts=32, top_k=4, heads=64, kv_heads=8, head_dim=64,
                           sliding_window=128, vocab=TINY_VOCAB, dtype="BF16", **GPT_OSS_SHAPES[shape])


def write_gpt_oss_gguf(folder: Path, shape: str = "20b-4l", routing: str = "random") -> Path:
    """`folder`/gptoss-`shape`-mxfp4.gguf (made once: an existing file is returned as it is)."""
    out = folder / f"gptoss-{shape}-mxfp4.gguf"
    if routing == "uniform":
        return uniform_routing(write_gpt_oss_gguf(folder, shape), folder / f"gptoss-{shape}-uniform-mxfp4.gguf")
    if out.is_file():
        return out
    from tests.gguf_convert import convert, save_tiny_tokenizer

    hf = folder / f"gptoss-{shape}-hf"
    s = gpt_oss_shape(shape)
    hf.mkdir(parents=True, exist_ok=True)
    config = s.config() | {"quantization_config": {"quant_method": "mxfp4",
                                                   "modules_to_not_convert": ["model.layers.*.self_attn"]}}
    (hf / "config.json").write_text(json.dumps(config, indent=1))
    C, V = s.hidden, s.vocab
    shards = [[("model.embed_tokens.weight", (V, C), 1.0), ("model.norm.weight", (C,), 0.0),
               ("lm_head.weight", (V, C), 4 * C**-0.5)]] + [list(s.layer_tensors(i)) for i in range(s.layers)]
    weight_map: dict[str, str] = {}
    rng = np.random.default_rng(0)
    for k, tensors in enumerate(shards):
        name = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        arrays = dict(_gpt_oss_arrays(tensors, rng))
        _save(hf / name, arrays)
        weight_map |= dict.fromkeys(arrays, name)
        del arrays
    (hf / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    save_tiny_tokenizer(hf, "gpt_oss")
    convert(hf, out, outtype="q8_0")
    return out


def _gpt_oss_arrays(tensors: list[tuple[str, tuple[int, ...], float]], rng: np.random.Generator
                    ) -> Iterator[tuple[str, np.ndarray]]:
    """(name, array) of one shard: experts as MXFP4 `_blocks` [E, out, in/32, 16] and `_scales` [E, out, in/32]
    (transformers' [E, in, out] transposed, as published), the rest as float32 (stored BF16 by `_save`)."""
    for name, shape, std in tensors:
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            e, n_in, n_out = shape
            yield name + "_blocks", rng.integers(0, 256, (e, n_out, n_in // 32, 16), dtype=np.uint8)
            yield name + "_scales", np.full((e, n_out, n_in // 32), MXFP4_SCALE, np.uint8)
        elif std == 0.0:  # a norm: ones plus noise
            yield name, (1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32))
        else:
            yield name, rng.standard_normal(shape, dtype=np.float32) * np.float32(std)


def _save(path: Path, arrays: dict[str, np.ndarray]) -> None:
    import torch
    from safetensors.torch import save_file

    tensors = {k: torch.from_numpy(v) if v.dtype == np.uint8 else torch.from_numpy(v).to(torch.bfloat16)
               for k, v in arrays.items()}
    save_file(tensors, str(path), metadata={"format": "pt"})


CALIBRATION = (0, 1024, 256)  # vocabulary rounds (seed 1) the uniform routers are fitted on, windows from position 0
ATTN_SCALE = 0.1  # a random model's attention adds one vector per sequence to every router input: shrink it


def uniform_routing(src: Path, out: Path, passes: int = 2) -> Path:
    """A copy of `src` whose routers spread top-k evenly: attention's output scaled by `ATTN_SCALE` (else each
    sequence's attention average favours a few experts for all its tokens), then each layer's router refitted on
    `CALIBRATION` as whitened principal directions with no mean, at the old logits' spread; `passes` rounds."""
    if out.is_file():
        return out
    from twinfer.backends.llamacpp.routing import trace, vocabulary_text
    from twinfer.runtime.loaders.gguf_reader import GGUFContents

    tmp = out.with_suffix(".part")
    shutil.copyfile(src, tmp)
    first, stop, window = CALIBRATION
    text = vocabulary_text(src, stop, seed=1)
    tensors = GGUFContents(tmp).tensors
    rng = np.random.default_rng(0)
    data = np.memmap(tmp, np.uint8, "r+")
    for info in tensors.values():
        if info.name.endswith("attn_output.weight"):
            _scale(data[info.offset : info.offset + info.nbytes], info.ggml_type, ATTN_SCALE)
    for _ in range(passes):
        inputs: dict[int, list[np.ndarray]] = {}
        for at in range(first, stop, window):
            for layer, rows in trace(tmp, text[at : at + window], [], capture=True)[0].inputs.items():
                inputs.setdefault(layer, []).extend(rows)
        for layer, rows in inputs.items():
            info = tensors[f"blk.{layer}.ffn_gate_inp.weight"]
            assert info.ggml_type == 0, f"{info.name}: F32 routers only"  # llama.cpp's converter keeps them F32
            w = data[info.offset : info.offset + info.nbytes].view(np.float32).reshape(info.shape)
            w[:] = _uniform_router(np.concatenate(rows), w, rng)
            if f"blk.{layer}.ffn_gate_inp.bias" in tensors:  # gpt-oss: a bias would favour experts again
                b = tensors[f"blk.{layer}.ffn_gate_inp.bias"]
                data[b.offset : b.offset + b.nbytes] = 0
        data.flush()
    del data
    tmp.rename(out)
    return out


def _scale(raw: np.ndarray, ggml_type: int, by: float) -> None:
    """Multiply a GGUF tensor's bytes in place: F32, F16, BF16, or Q8_0 (its f16 block scales)."""
    if ggml_type == 0:
        raw.view(np.float32)[:] *= by
    elif ggml_type == 1:
        raw.view(np.float16)[:] *= by
    elif ggml_type == 30:  # BF16: the top half of a float32
        u = raw.view(np.uint16)
        u[:] = (((u.astype(np.uint32) << 16).view(np.float32) * by).view(np.uint32) >> 16).astype(np.uint16)
    elif ggml_type == 8:  # Q8_0: 34-byte blocks, an f16 scale then 32 int8
        scales = raw.reshape(-1, 34)[:, :2]
        scales[:] = (scales.copy().view(np.float16) * by).view(np.uint8)
    else:
        raise ValueError(f"uniform routing: cannot scale ggml type {ggml_type}")


def _uniform_router(x: np.ndarray, w: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Router [experts, hidden] for inputs `x` [tokens, hidden]: random orthonormal mixes of the top E whitened
    principal directions orthogonal to the mean, scaled to the spread of `w`'s logits."""
    e = w.shape[0]
    mean = x.mean(axis=0)
    unit = mean / max(float(np.linalg.norm(mean)), 1e-12)
    centred = x - mean
    centred -= np.outer(centred @ unit, unit)
    _, sv, vt = np.linalg.svd(centred.astype(np.float64), full_matrices=False)
    m = min(e, int((sv > sv[0] * 1e-6).sum()))
    mix = np.linalg.qr(rng.standard_normal((m, e)))[0].T  # [e, m], orthonormal rows
    router = mix @ (vt[:m] / sv[:m, None]) * np.sqrt(len(x))
    return (router * float((x @ w.T).std())).astype(np.float32)
