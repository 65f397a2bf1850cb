"""Tiny random vision checkpoints for the image tests: a Gemma 3 `Gemma3ForConditionalGeneration` (SigLIP
tower + projector + Gemma 3 text model) saved with save_pretrained, with a character tokenizer that
knows Gemma's image tokens and an image processor (processor_config.json), so twinfer opens the folder
as it opens a released checkpoint.

`save_tiny_gemma3_vision(folder)` writes it; `tiny_gemma3_vision()` is the (cached) transformers model;
`gemma3_pixel_values(image)` is transformers' own preprocessing of an `Image`'s pixels.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

# Token ids of the tiny vocabulary: specials first, then newline runs, then printable ASCII.
SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>",
            "<start_of_image>", "<end_of_image>", "<image_soft_token>")
NEWLINES = ("\n", "\n\n", "\n\n\n", "\n\n\n\n")
VOCAB: dict[str, int] = {t: i for i, t in enumerate((*SPECIALS, *NEWLINES, *(chr(c) for c in range(32, 127))))}
BOI, EOI, IMAGE_TOKEN = VOCAB["<start_of_image>"], VOCAB["<end_of_image>"], VOCAB["<image_soft_token>"]
VOCAB_SIZE = 128
IMAGE_SIZE = 32  # pixels a side: 8 x 8 patches of 4, pooled to 4 x 4 = 16 tokens
MM_TOKENS = 16
TEXT_CONFIG = dict(
    vocab_size=VOCAB_SIZE, hidden_size=64, num_hidden_layers=7, num_attention_heads=4, num_key_value_heads=1,
    intermediate_size=80, head_dim=32, sliding_window=8, query_pre_attn_scalar=32, max_position_embeddings=256,
    pad_token_id=0, eos_token_id=1, bos_token_id=2,
)  # 7 layers: sliding ones and a global one; a window of 8 is shorter than one image's 16 tokens
VISION_CONFIG = dict(
    hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, image_size=IMAGE_SIZE,
    patch_size=4, vision_use_head=False, layer_norm_eps=1e-6,
)


@cache
def tiny_gemma3_vision(seed: int = 0) -> Any:
    """A random-weight fp32 `Gemma3ForConditionalGeneration` (cached; do not modify it). Norm weights and
    the projector are random too, so a missed `1 +` or an unscaled projection shows."""
    import torch
    import transformers

    config = transformers.Gemma3Config(
        text_config=TEXT_CONFIG, vision_config=dict(VISION_CONFIG, model_type="siglip_vision_model"),
        mm_tokens_per_image=MM_TOKENS, boi_token_index=BOI, eoi_token_index=EOI, image_token_index=IMAGE_TOKEN,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "mm_input_projection" in name:
                p.normal_(0.0, 0.5)
    return model.eval()


def tiny_tokenizer() -> Any:
    """A transformers tokenizer over `VOCAB`: one token per character, newline runs of up to four as one
    token (as Gemma's vocabulary has them), the specials parsed whole."""
    import transformers
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(dict(VOCAB), unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\n{1,4}|[^\n]"), "isolated")
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
        additional_special_tokens=["<start_of_turn>", "<end_of_turn>"],
        extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                              "image_token": "<image_soft_token>"},
    )


def image_processor() -> Any:
    """transformers' Gemma 3 image processor at the tiny tower's size (bilinear, x/255, (x - 0.5)/0.5)."""
    import transformers

    return transformers.Gemma3ImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})


def save_tiny_gemma3_vision(folder: str | Path, seed: int = 0) -> Path:
    """Write the tiny Gemma 3 vision checkpoint into `folder`: config.json, model.safetensors (fp32),
    the tokenizer with its Gemma 3 chat template, and processor_config.json. Returns the folder."""
    import transformers

    from twinfer.runtime.models.gemma3 import CHAT_TEMPLATE

    path = Path(folder)
    tiny_gemma3_vision(seed).save_pretrained(path)
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    processor = transformers.Gemma3Processor(image_processor(), tokenizer, image_seq_length=MM_TOKENS)
    processor.chat_template = CHAT_TEMPLATE
    processor.save_pretrained(path)
    return path


def gemma3_pixel_values(pixels: np.ndarray) -> Any:
    """transformers' pixel_values [1, 3, S, S] (float32 torch) for uint8 [H, W, 3] pixels."""
    import torch

    out = image_processor()(images=[pixels], return_tensors="pt")["pixel_values"]
    return out.to(torch.float32)


def random_pixels(seed: int, height: int = IMAGE_SIZE, width: int = IMAGE_SIZE) -> np.ndarray:
    """Fixed random uint8 RGB pixels [height, width, 3]."""
    return np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
