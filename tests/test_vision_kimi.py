"""Kimi K2.5's vision side (runtime/vision/kimi_k25.py) on torch and MLX against transformers.

A tiny random `Kimi_K25ForConditionalGeneration` (a two-layer MoonViT with a 6 x 6 position grid, the
patch merger, a tiny DeepSeek-V3 text model) is saved as Moonshot publishes it. Checked: pixel values
equal transformers' image processor's (its own sizing function and torch's uint8 antialiased resize);
tower + projector features within 1e-4 of `get_image_features`; the logits of prompts with images within
1e-4 of transformers over a prefill (whole, or split inside an image) and 8 greedy decode steps.
"""

from __future__ import annotations

import ast
import inspect
import json
import math
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("mlx.core")

from fixtures_models import random_causal_lm  # noqa: E402
from test_arch_logits import TOL  # noqa: E402
from test_arch_today_moe import BASE, KIMI, save_kimi_published  # noqa: E402

from twinfer.backends.cuda.runner import load_torch_runner  # noqa: E402
from twinfer.backends.metal.runner import load_mlx_runner  # noqa: E402
from twinfer.runtime.batch import LogitsWanted, SeqChunk, StepBatch  # noqa: E402
from twinfer.runtime.loaders import load_model  # noqa: E402
from twinfer.runtime.vision import ChunkImage, Image  # noqa: E402
from twinfer.runtime.vision.kimi_k25 import KimiVisionTower  # noqa: E402
from twinfer.runtime.vision.kimi_k25_image import ImageSettings, block_positions, patches  # noqa: E402

IMAGE_TOKEN = 120  # `<|media_pad|>` of the tiny vocabulary
VISION = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=48, num_attention_heads=2, patch_size=4,
              pos_emb_height=6, pos_emb_width=6, pos_emb_time=1)
MAX_SIDE = 10  # patches a side: a larger image is resized (processor_config.json)
DECODE_STEPS = 8
BLOCK = 4
BACKENDS = ["mlx", "torch"]
_ROOT = tempfile.TemporaryDirectory()


@cache
def kimi_vision_model() -> Any:
    """transformers' Kimi K2.5 with random weights everywhere: the text model's from fixtures_models, the
    tower's and projector's scaled so features are O(1) and norms and biases matter."""
    text_kwargs = {**BASE, **KIMI["kimi_k25-a"]}
    text = random_causal_lm("DeepseekV3", text_kwargs)
    del text_kwargs["attn_implementation"]
    config = transformers.Kimi_K25Config(text_config=dict(text_kwargs, model_type="kimi_k2"), vision_config=VISION,
                                         projection_hidden_size=32, tie_word_embeddings=False,
                                         image_token_id=IMAGE_TOKEN)
    config._attn_implementation = "eager"
    model = transformers.Kimi_K25ForConditionalGeneration(config).eval()
    model.model.language_model.load_state_dict(text.model.state_dict())
    model.lm_head.load_state_dict(text.lm_head.state_dict())
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "vision_tower" in name or "mm_projector" in name:
                if "norm" in name:
                    p.normal_(1.0 if name.endswith("weight") else 0.0, 0.2)
                else:
                    p.normal_(0.0, 0.05 if "out_proj" in name else 0.2)
    return model


@cache
def kimi_folder() -> Path:
    folder = Path(_ROOT.name) / "kimi_k25_vision"
    save_kimi_published(kimi_vision_model(), folder)
    processor = {"image_processor": {"size": {"max_height": MAX_SIDE, "max_width": MAX_SIDE}, "patch_size": 4,
                                     "merge_size": 2, "max_patches": 16384}}
    (folder / "processor_config.json").write_text(json.dumps(processor))
    return folder


@cache
def runner(backend: str) -> Any:
    """The runner every face builds for the folder: `runner.vision` comes from the checkpoint."""
    load = {"torch": load_torch_runner, "mlx": load_mlx_runner}[backend]
    r = load(load_model(kimi_folder()), kv_tokens=64 * BLOCK, block_size=BLOCK)
    assert isinstance(r.vision, KimiVisionTower)
    return r


def image(height: int, width: int, seed: int) -> Image:
    return Image(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def hf_pixels(tower: KimiVisionTower, im: Image) -> tuple[Any, Any]:
    """(pixel_values [N, 3, p, p] in raster order, image_grid_thw [1, 3]) from twinfer's preprocessing."""
    x, (gh, gw) = patches(tower.cfg.image, im.pixels)
    rows, cols = block_positions(gh, gw, tower.cfg.merge)
    raster = np.zeros_like(x)
    raster[rows * gw + cols] = x
    p = tower.cfg.image.patch
    return torch.from_numpy(raster).reshape(-1, 3, p, p), torch.tensor([[1, gh, gw]])


# -- preprocessing -----------------------------------------------------------------------------------
def navit_resize() -> Any:
    """transformers' own `navit_resize`, taken from its source (the module imports torchvision)."""
    import transformers.models.kimi_k25 as pkg

    path = Path(inspect.getfile(pkg)).parent / "image_processing_kimi_k25.py"
    tree = ast.parse(path.read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "navit_resize")
    namespace: dict[str, Any] = {"math": math}
    exec(compile(ast.Module([fn], []), str(path), "exec"), namespace)
    return namespace["navit_resize"]


def processor_pixels(px: np.ndarray, s: ImageSettings) -> tuple[np.ndarray, tuple[int, int]]:
    """`Kimi_K25ImageProcessor._preprocess` step by step with the torch calls torchvision makes: uint8
    antialiased bicubic resize, zero padding, (x - 255 mean) / (255 std) in float32, patchify."""
    import torch.nn.functional as F

    (h, w), (ph, pw) = navit_resize()(px.shape[0], px.shape[1], s.patch, s.merge, s.max_patches, s.max_side)
    t = torch.from_numpy(px).permute(2, 0, 1)[None].contiguous()
    if (h, w) != px.shape[:2]:
        t = F.interpolate(t, size=(h, w), mode="bicubic", antialias=True, align_corners=False)
    t = F.pad(t, (0, pw - w, 0, ph - h)).float()
    mean = torch.tensor(s.mean) * (1.0 / s.rescale)
    std = torch.tensor(s.std) * (1.0 / s.rescale)
    t = ((t[0] - mean[:, None, None]) / std[:, None, None])
    gh, gw = ph // s.patch, pw // s.patch
    t = t.reshape(3, gh, s.patch, gw, s.patch).permute(1, 3, 0, 2, 4).reshape(gh * gw, -1)
    return t.numpy(), (gh, gw)


@pytest.mark.parametrize(("size", "settings"), [
    ((30, 45), ImageSettings(patch=4, max_side=512)),  # padded, not resized
    ((100, 80), ImageSettings(patch=4, max_side=6)),  # the per-side limit shrinks it
    ((100, 80), ImageSettings(patch=4, max_patches=50)),  # the patch budget shrinks it
    ((257, 131), ImageSettings(patch=14, max_side=8, max_patches=40)),
])  # fmt: skip
def test_pixels_equal_transformers_processor(size: tuple[int, int], settings: ImageSettings) -> None:
    px = image(*size, seed=size[0]).pixels
    ours, grid = patches(settings, px)
    ref, ref_grid = processor_pixels(px, settings)
    rows, cols = block_positions(*grid, settings.merge)
    assert grid == ref_grid and settings.tokens(*size) == grid[0] * grid[1] // 4
    assert np.array_equal(ours, ref[rows * grid[1] + cols])


# -- tower + projector -------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("size", [(30, 45), (100, 60), (8, 8)])
def test_features_match_transformers(backend: str, size: tuple[int, int]) -> None:
    r = runner(backend)
    im = image(*size, seed=sum(size))
    pixel_values, grid = hf_pixels(r.vision, im)
    with torch.no_grad():
        ref = kimi_vision_model().model.get_image_features(pixel_values, grid).pooler_output[0].numpy()
    ours = np.asarray(r.ops.to_host(r.vision.encode(im)))
    err = float(np.abs(ours - ref).max())
    print(f"{backend} {size}: {ours.shape[0]} tokens, max |dfeature| = {err:.2e}")
    assert ours.shape == ref.shape == (r.vision.cfg.image.tokens(*size), 64) and err <= TOL


# -- a prompt with images through the language model ---------------------------------------------------
PROMPTS = (([3, 17, IMAGE_TOKEN, 5, 64, 8], (30, 45)), ([9, 33, 101, IMAGE_TOKEN, 7, 60, 2], (100, 60)))


def run_prompt(r: Any, seq: int, prompt: list[int], im: Image, table: list[int],
               split: int | None) -> tuple[np.ndarray, list[int], list[int]]:
    """Prefill (in two chunks at `split` when given) and greedy decode; (logit rows, expanded prompt, new)."""
    ids, spans = r.vision.expand(prompt, [im])
    span, features = spans[0], r.vision.encode(im)
    bounds = [0, len(ids)] if split is None else [0, split, len(ids)]
    rows = []
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        a, b = max(lo, span.start), min(hi, span.end)  # the image rows this chunk covers
        images = [ChunkImage(a - lo, features[a - span.start : b - span.start])] if a < b else []
        chunk = SeqChunk(seq, ids[lo:hi], lo, table, LogitsWanted.ALL, images=images)
        rows.append(r.step(StepBatch([chunk])))
    new: list[int] = []
    for _ in range(DECODE_STEPS):
        new.append(int(rows[-1][-1].argmax()))
        rows.append(r.step(StepBatch([SeqChunk(seq, [new[-1]], len(ids) + len(new) - 1, table)])))
    return np.concatenate(rows), ids, new


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("split", [None, 4], ids=["whole", "split-in-image"])
def test_logits_with_images_match_transformers(backend: str, split: int | None) -> None:
    r = runner(backend)
    worst = 0.0
    for seq, (prompt, size) in enumerate(PROMPTS):
        im = image(*size, seed=seq)
        rows, ids, new = run_prompt(r, seq, prompt, im, [20 * seq + i for i in range(20)], split)
        r.release(seq)
        pixel_values, grid = hf_pixels(r.vision, im)
        with torch.no_grad():
            ref = kimi_vision_model()(torch.tensor([ids + new]), pixel_values=pixel_values,
                                      image_grid_thw=grid).logits[0].numpy()[: len(rows)]
        worst = max(worst, float(np.abs(rows - ref).max()))
    print(f"{backend} {split}: max |dlogit| = {worst:.2e}")
    assert worst <= TOL


def test_expand_counts_and_weights() -> None:
    tower = runner("torch").vision
    ims = [image(30, 45, 0), image(100, 60, 1)]
    ids, spans = tower.expand([1, IMAGE_TOKEN, 2, IMAGE_TOKEN], ims)
    assert [(s.start, s.length) for s in spans] == [(1, 20), (22, 15)]  # resized to 26 x 40 and 40 x 24 pixels
    assert len(ids) == 2 + 20 + 15 and ids[1:21] == [IMAGE_TOKEN] * 20 and ids[21] == 2
    with pytest.raises(ValueError, match="2 image markers"):
        tower.expand([IMAGE_TOKEN, IMAGE_TOKEN], ims[:1])
    state = kimi_vision_model().state_dict()
    vision = sum(v.numel() for k, v in state.items() if "vision_tower" in k or "mm_projector" in k)
    assert tower.weight_bytes() == 4 * vision  # fp32, every tensor once
