"""Gemma 3 reads images on torch and MLX like transformers' Gemma3ForConditionalGeneration.

A tiny random checkpoint (tests/vision_models.py) with a SigLIP tower; a prompt with one image. The
runner is driven with StepBatch/SeqChunk(images=[ChunkImage]) directly: a text-only sequence and an image
sequence prefilled in two chunks in one batch, then 8 greedy decode steps, within 1e-4 of transformers
in fp32. Another image changes the logits as it does in transformers, and attending causally inside the
image (no bidirectional block) is far from the reference, so the check would catch it.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from vision_models import (
    BOI,
    IMAGE_TOKEN,
    MM_TOKENS,
    gemma3_pixel_values,
    random_pixels,
    save_tiny_gemma3_vision,
    tiny_gemma3_vision,
)

from twinfer.runtime.batch import LogitsWanted, SeqChunk, StepBatch
from twinfer.runtime.loaders import load_model
from twinfer.runtime.runner import Runner
from twinfer.runtime.tokenizer import load_tokenizer
from twinfer.runtime.vision import ChunkImage, Image
from twinfer.runtime.vision.gemma3 import preprocess, read_vision_config

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("mlx.core")

from twinfer.backends.cuda.runner import load_torch_runner  # noqa: E402
from twinfer.backends.metal.runner import load_mlx_runner  # noqa: E402

TOL = 1e-4
DECODE_STEPS = 8
BLOCK = 4
SPLIT = 6  # the image sequence's first prefill chunk: text only, the image lies wholly in the second
TEXT_PROMPT = "<bos><start_of_turn>user\nHello there<end_of_turn>\n<start_of_turn>model\n"
IMAGE_PROMPT = "<bos><start_of_turn>user\nLook:\n<start_of_image>what is it?<end_of_turn>\n<start_of_turn>model\n"
LOADERS = {"torch": load_torch_runner, "mlx": load_mlx_runner}
_DIR = Path(__import__("tempfile").mkdtemp(prefix="twinfer-gemma3v-"))


@cache
def folder() -> Path:
    return save_tiny_gemma3_vision(_DIR / "gemma3-vision")


@cache
def runner(backend: str) -> Runner:
    r = LOADERS[backend](load_model(folder()), kv_tokens=128 * BLOCK, block_size=BLOCK)
    assert r.vision is not None
    return r


def prompt_ids(text: str) -> list[int]:
    return load_tokenizer(folder()).encode(text, add_special_tokens=False)


def pixels(seed: int) -> np.ndarray:
    return random_pixels(seed, 40, 30)  # resized to the tower's 32 x 32


@cache
def reference(tokens: tuple[int, ...], seed: int | None, bidirectional: bool = True) -> np.ndarray:
    """transformers' fp32 logits [len(tokens), V] (`seed`: the image's pixels, None: text only); the image's
    tokens are marked (token_type_ids) so they attend both ways unless `bidirectional` is False."""
    ids = torch.tensor([tokens])
    kwargs: dict[str, Any] = {}
    if seed is not None:
        kwargs["pixel_values"] = gemma3_pixel_values(pixels(seed))
        if bidirectional:
            kwargs["token_type_ids"] = (ids == IMAGE_TOKEN).long()
    with torch.no_grad():
        return tiny_gemma3_vision()(input_ids=ids, **kwargs).logits[0].float().numpy()


@cache
def generate(backend: str, seed: int, bidirectional: bool = True) -> dict[int, tuple[np.ndarray, list[int]]]:
    """Both sequences' logit rows (prefill, then one per decode step) and their full token lists."""
    r = runner(backend)
    assert r.vision is not None
    image = Image(pixels(seed))
    tokens = {0: prompt_ids(TEXT_PROMPT)}
    tokens[1], spans = r.vision.expand(prompt_ids(IMAGE_PROMPT), [image])
    assert len(spans) == 1 and spans[0].start > SPLIT
    features = r.vision.encode(image)
    tables = {0: list(range(0, 64)), 1: list(range(64, 128))}
    rows = {s: [] for s in tokens}
    first = r.step(StepBatch([SeqChunk(0, tokens[0], 0, tables[0], LogitsWanted.ALL),
                              SeqChunk(1, tokens[1][:SPLIT], 0, tables[1], LogitsWanted.ALL)]))
    rows[0].append(first[: len(tokens[0])])
    rows[1].append(first[len(tokens[0]):])
    picture = ChunkImage(spans[0].start - SPLIT, features, bidirectional)
    rows[1].append(r.step(StepBatch([SeqChunk(1, tokens[1][SPLIT:], SPLIT, tables[1], LogitsWanted.ALL,
                                              images=[picture])])))
    for _ in range(DECODE_STEPS):
        for s in tokens:
            tokens[s].append(int(rows[s][-1][-1].argmax()))
        out = r.step(StepBatch([SeqChunk(s, tokens[s][-1:], len(tokens[s]) - 1, tables[s]) for s in tokens]))
        for i, s in enumerate(tokens):
            rows[s].append(out[i : i + 1])
    return {s: (np.concatenate(rows[s]), tokens[s]) for s in tokens}


def max_error(backend: str, seed: int) -> float:
    worst = 0.0
    for s, (rows, tokens) in generate(backend, seed).items():
        ref = reference(tuple(tokens[: len(rows)]), seed if s == 1 else None)
        worst = max(worst, float(np.abs(rows - ref).max()))
    return worst


@pytest.mark.parametrize("backend", sorted(LOADERS))
def test_logits_match_transformers(backend: str) -> None:
    err = max_error(backend, 1)
    print(f"gemma3 vision {backend}: max |dlogit| = {err:.2e}")
    assert err <= TOL


@pytest.mark.parametrize("backend", sorted(LOADERS))
def test_another_image_changes_the_logits(backend: str) -> None:
    """Same prompt, other pixels: transformers' logits move, and ours move with them."""
    rows_a, tokens = generate(backend, 1)[1]
    rows_b = generate(backend, 2)[1][0]
    n = len(prompt_ids(IMAGE_PROMPT)) + MM_TOKENS + 3  # the prefill rows (same tokens for both images)
    assert float(np.abs(reference(tuple(tokens[:n]), 1) - reference(tuple(tokens[:n]), 2)).max()) > 0.05
    assert float(np.abs(rows_a[:n] - rows_b[:n]).max()) > 0.05
    assert max_error(backend, 2) <= TOL


@pytest.mark.parametrize("backend", sorted(LOADERS))
def test_bidirectional_image_attention_is_needed(backend: str) -> None:
    """Causal attention inside the image matches transformers only without token_type_ids: the reference
    check above would catch a runner that left the bidirectional block out."""
    rows, tokens = generate(backend, 1, bidirectional=False)[1]
    n = len(rows) - DECODE_STEPS
    assert float(np.abs(rows[:n] - reference(tuple(tokens[:n]), 1, bidirectional=False)).max()) <= TOL
    assert float(np.abs(rows[:n] - reference(tuple(tokens[:n]), 1)).max()) > 0.05


@pytest.mark.parametrize("prompt", [
    "<bos>hi <start_of_image> there",
    "<bos>a\n<start_of_image>\nb",
    "<start_of_image>",
    "<bos>x\n\n<start_of_image>\n\n\ny<start_of_image><start_of_image>z\n",
])  # fmt: skip
def test_expansion_matches_the_processor(prompt: str) -> None:
    """The placeholder run and the newline runs around it, as transformers' processor tokenizes them."""
    vision = runner("torch").vision
    assert vision is not None
    images = [random_pixels(i, 32, 32) for i in range(prompt.count("<start_of_image>"))]
    processor = transformers.AutoProcessor.from_pretrained(folder())
    ref = processor(text=prompt, images=images, return_tensors="pt")
    tokens, spans = vision.expand(prompt_ids(prompt), [Image(p) for p in images])
    assert tokens == ref["input_ids"][0].tolist()
    marked = [i for i, t in enumerate(ref["token_type_ids"][0].tolist()) if t]
    assert [i for s in spans for i in range(s.start, s.end)] == marked
    assert all(tokens[s.start - 1] == BOI for s in spans)


def test_expansion_needs_one_image_per_marker() -> None:
    vision = runner("torch").vision
    assert vision is not None
    with pytest.raises(ValueError, match="1 image markers"):
        vision.expand(prompt_ids("<bos><start_of_image>"), [])


@pytest.mark.parametrize("size", [(32, 32), (40, 30), (17, 50)])
def test_preprocessing_matches_transformers(size: tuple[int, int]) -> None:
    """Bilinear resize, x/255, (x - 0.5)/0.5: the processor's pixel_values, cut into patches."""
    config = read_vision_config(folder(), load_model(folder()).metadata)
    assert config is not None
    pixels = random_pixels(3, *size)
    p, P = config.patch_size, config.patches_per_side
    ref = gemma3_pixel_values(pixels)[0].numpy()  # [3, S, S]
    ref = ref.reshape(3, P, p, P, p).transpose(1, 3, 0, 2, 4).reshape(P * P, -1)
    assert float(np.abs(preprocess(pixels, config) - ref).max()) <= 1e-6


def test_weight_bytes_count_the_tower_and_projector() -> None:
    model = tiny_gemma3_vision()
    params = [p for n, p in model.named_parameters() if "vision_tower" in n or "multi_modal_projector" in n]
    vision = runner("mlx").vision
    assert vision is not None and vision.weight_bytes() == sum(p.numel() for p in params) * 4


def test_a_text_only_checkpoint_has_no_tower(tmp_path: Path) -> None:
    from fixtures_models import hf_model

    hf_model("gemma3").save_pretrained(tmp_path)
    assert load_torch_runner(load_model(tmp_path), kv_tokens=64, block_size=BLOCK).vision is None
