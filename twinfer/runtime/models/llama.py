"""Llama 2/3: the plain pre-norm decoder of `base.Model`, SiLU-gated MLP, NeoX rope. The GGUF table
un-permutes llama.cpp's Q/K rows; a GGUF "llama" with experts becomes a `mixtral` spec."""

from __future__ import annotations

from pathlib import Path

from twinfer.runtime.loaders.names import NameTable, rule
from twinfer.runtime.models.arch import Architecture, Fields
from twinfer.runtime.models.base import Model as _Decoder
from twinfer.runtime.models.common import GGUF_COMMON, GGUF_MOE, HF_DECODER


class Model(_Decoder):
    pass


GGUF_QK_PERMUTED = (
    rule("blk.{i}.attn_q.weight", "layers.{i}.q", "unpermute_q"),
    rule("blk.{i}.attn_k.weight", "layers.{i}.k", "unpermute_k"),
    rule("blk.{i}.attn_q.bias", "layers.{i}.q_bias", "unpermute_q"),
    rule("blk.{i}.attn_k.bias", "layers.{i}.k_bias", "unpermute_k"),
)
GGUF_NAMES = NameTable(
    "llama GGUF",
    GGUF_COMMON + GGUF_QK_PERMUTED + GGUF_MOE + (rule("rope_freqs.weight", "rope_freqs"),),
    optional=("rope_freqs",),  # llama 3.x rope frequency factors, precomputed by the converter
)


def gguf_spec(keys: object, fields: Fields) -> Fields:
    """A llama-architecture GGUF with experts is Mixtral."""
    return fields | {"model_type": "mixtral"} if fields["moe"] is not None else fields


ARCH = Architecture(
    name="llama",
    model=Model,
    hf_names=HF_DECODER.extended("llama"),
    gguf_names=GGUF_NAMES,
    hf_defaults={"vocab_size": 32000, "max_position_embeddings": 2048},
    gguf_spec=gguf_spec,
)


def write_probe_gguf(path: Path) -> None:
    """A one-layer llama GGUF of random Q8_0 weights (256 wide, 256 byte tokens, 0.85 MB) for
    backends/llamacpp/amx.py: every matmul is one ggml's AMX buffer takes, so its kernels run on the
    first batch, in a child that stays ~50 MB."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(0)
    width, ffn, vocab, heads = 256, 512, 256, 4
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(256)
    w.add_embedding_length(width)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(heads)
    w.add_rope_dimension_count(width // heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    w.add_tokenizer_model("llama")
    w.add_token_list(["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(vocab - 3)])
    w.add_token_scores([0.0] * vocab)
    w.add_token_types([2, 3, 3] + [6] * (vocab - 3))  # unknown, control, control, then bytes
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)

    def q8_0(name: str, rows: int, cols: int) -> None:
        q = gguf.quants.quantize((rng.standard_normal((rows, cols)) * 0.05).astype(np.float32),
                                 gguf.GGMLQuantizationType.Q8_0)
        w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)

    q8_0("token_embd.weight", vocab, width)
    q8_0("output.weight", vocab, width)
    w.add_tensor("output_norm.weight", np.ones(width, dtype=np.float32))
    w.add_tensor("blk.0.attn_norm.weight", np.ones(width, dtype=np.float32))
    w.add_tensor("blk.0.ffn_norm.weight", np.ones(width, dtype=np.float32))
    for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
        q8_0(f"blk.0.{name}.weight", width, width)
    q8_0("blk.0.ffn_gate.weight", ffn, width)
    q8_0("blk.0.ffn_up.weight", ffn, width)
    q8_0("blk.0.ffn_down.weight", width, ffn)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
