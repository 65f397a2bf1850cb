"""A random-weight Llama of about 0.85B parameters as a Q4_K_M GGUF: a second model for the CPU planner's checks.

The default model (Gemma 3 270M) is small and unusual: its tied 262,144-token head is 63% of its matmul
work, and at 18 layers of width 640 the fixed cost of each op is a large share of a step. This one is
shaped like the models people run on a laptop (width 2,048, 16 layers, GQA 16/4, a 32,000-token head
of its own), with weights drawn from seed 0, converted by llama.cpp's own `convert_hf_to_gguf.py` (from
the installed llama-cpp-python's sdist, as the tests get it) and quantized by `llama_model_quantize`.
Nothing is downloaded but that sdist. Random weights change no timing: every weight is read and
multiplied whatever its value.

    python bench/make_random_gguf.py --out /tmp/llama1b        # about a minute on two cores
    python bench/make_random_gguf.py --out /tmp/tl --shape tinyllama   # 1.1B, TinyLlama's shape
    twinfer plan /tmp/llama1b/llama1b-q4_k_m.gguf --context 64
    twinfer bench /tmp/llama1b/llama1b-q4_k_m.gguf -c 1 -p 64 -o 64

llama.cpp's converter reads a Llama tokenizer through sentencepiece: `pip install sentencepiece` first.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

Q4_K_M = 15  # LLAMA_FTYPE_MOSTLY_Q4_K_M
SHAPES = {"llama1b": (16, 16, 500000.0), "tinyllama": (22, 32, 10000.0)}  # layers, heads, rope theta


def fill_vocab(folder: Path, size: int) -> None:
    """Fill the tokenizer up to `size` with plain tokens ("<t320>", ...). Left to the converter, the missing
    ids become unused [PAD] tokens that detokenize to nothing, and a random head picks them nearly always:
    llama-server then streams empty text, which load generators count as failed requests."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    tok.add_tokens([f"<t{i}>" for i in range(len(tok), size)])
    assert len(tok) == size, len(tok)
    tok.save_pretrained(folder)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for the Hugging Face copy and the GGUF files")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama1b",
                    help="llama1b: 0.85B, 16 layers; tinyllama: TinyLlama-1.1B's shape (22 layers, 32 heads)")
    a = ap.parse_args()
    try:
        import sentencepiece  # noqa: F401
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as e:
        raise SystemExit(f"make_random_gguf: {e.name} is missing (pip install torch transformers sentencepiece)") from e
    import llama_cpp

    from tests.gguf_convert import convert, save_tiny_tokenizer

    out = Path(a.out)
    hf = out / "hf"
    layers, heads, theta = SHAPES[a.shape]
    cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=4, max_position_embeddings=8192,
                      rope_theta=theta, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.float16).save_pretrained(hf)
    save_tiny_tokenizer(hf, "deepseek")  # a byte-level BPE tokenizer of a few hundred tokens
    fill_vocab(hf, cfg.vocab_size)
    f16, q4 = out / f"{a.shape}-f16.gguf", out / f"{a.shape}-q4_k_m.gguf"
    convert(hf, f16, outtype="f16")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = Q4_K_M
    if llama_cpp.llama_model_quantize(str(f16).encode(), str(q4).encode(), params) != 0:
        raise SystemExit(f"make_random_gguf: llama.cpp could not quantize {f16}")
    print(q4)


if __name__ == "__main__":
    main()
