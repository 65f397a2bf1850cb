"""Gemma 3's image side (`Gemma3ForConditionalGeneration`): preprocessing, the SigLIP tower and the
multi-modal projector over Ops (torch and MLX run the same code), and the prompt's placeholder run.
docs/images.md, "Gemma 3", describes each step."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from twinfer.runtime.errors import ModelError
from twinfer.runtime.loaders.names import NameTable, map_weights, rule
from twinfer.runtime.loaders.weights import Transform, WeightSet, elementwise
from twinfer.runtime.ops import Array, Ops
from twinfer.runtime.spec import ModelSpec
from twinfer.runtime.vision import Image, ImageSpan

# transformers' defaults for what a released config leaves out (SiglipVisionConfig, Gemma3Config).
VISION_DEFAULTS: dict[str, Any] = {
    "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
    "num_channels": 3, "image_size": 224, "patch_size": 16, "layer_norm_eps": 1e-6,
    "hidden_act": "gelu_pytorch_tanh",
}
MM_DEFAULTS: dict[str, Any] = {
    "mm_tokens_per_image": 256, "boi_token_index": 255_999, "eoi_token_index": 256_000,
    "image_token_index": 262_144,
}
PROCESSOR_DEFAULTS: dict[str, Any] = {
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "rescale_factor": 1 / 255, "resample": 2,
}
BILINEAR = 2  # PIL's resample code, the one Gemma 3's processor uses
MAX_NEWLINES = 32  # Gemma's vocabulary holds newline runs up to 31 as single tokens


@dataclass(frozen=True)
class Gemma3VisionConfig:
    """The tower, projector and preprocessing of one checkpoint."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    layer_norm_eps: float
    mm_tokens_per_image: int
    text_hidden_size: int
    boi_id: int
    eoi_id: int
    image_token_id: int
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    rescale: float = 1 / 255

    def __post_init__(self) -> None:
        side = round(self.mm_tokens_per_image**0.5)
        if self.image_size % self.patch_size or side * side != self.mm_tokens_per_image \
                or self.patches_per_side % side or self.hidden_size % self.num_heads:
            raise ModelError(f"Gemma 3 vision config: {self.image_size}px images in {self.patch_size}px patches "
                             f"do not pool to {self.mm_tokens_per_image} tokens a square grid of whole cells")

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def tokens_per_side(self) -> int:
        return round(self.mm_tokens_per_image**0.5)

    @property
    def pool(self) -> int:
        """Patches a side that one image token averages."""
        return self.patches_per_side // self.tokens_per_side

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def read_vision_config(folder: Path, config: dict[str, Any]) -> Gemma3VisionConfig | None:
    """The vision side of a config.json dict (None: text only), preprocessing from processor_config.json
    (transformers 5) or preprocessor_config.json."""
    if not isinstance(config.get("vision_config"), dict):
        return None
    v = {**VISION_DEFAULTS, **config["vision_config"]}
    mm = {k: config.get(k, d) for k, d in MM_DEFAULTS.items()}
    if v["hidden_act"] not in ("gelu_pytorch_tanh", "gelu_tanh") or int(v["num_channels"]) != 3:
        raise ModelError(f"Gemma 3 vision tower with {v['hidden_act']} over {v['num_channels']} channels is "
                         "not supported (SigLIP's GELU(tanh) over RGB is)")
    p = _processor_settings(folder)
    text = config.get("text_config") or {}
    return Gemma3VisionConfig(
        hidden_size=int(v["hidden_size"]), intermediate_size=int(v["intermediate_size"]),
        num_layers=int(v["num_hidden_layers"]), num_heads=int(v["num_attention_heads"]),
        image_size=int(v["image_size"]), patch_size=int(v["patch_size"]), layer_norm_eps=float(v["layer_norm_eps"]),
        mm_tokens_per_image=int(mm["mm_tokens_per_image"]), text_hidden_size=int(text.get("hidden_size", 2304)),
        boi_id=int(mm["boi_token_index"]), eoi_id=int(mm["eoi_token_index"]),
        image_token_id=int(mm["image_token_index"]),
        mean=_three(p["image_mean"]), std=_three(p["image_std"]), rescale=float(p["rescale_factor"]),
    )


def _processor_settings(folder: Path) -> dict[str, Any]:
    out = dict(PROCESSOR_DEFAULTS)
    for name in ("preprocessor_config.json", "processor_config.json"):  # the newer file wins
        path = folder / name
        if path.is_file():
            data = json.loads(path.read_text(encoding="utf-8"))
            data = data.get("image_processor", data)
            out |= {k: data[k] for k in PROCESSOR_DEFAULTS if data.get(k) is not None}
    if int(out["resample"]) != BILINEAR:
        raise ModelError(f"{folder}: image resampling {out['resample']} is not supported (Gemma 3's is bilinear)")
    return out


def _three(values: Any) -> tuple[float, float, float]:
    a = [float(x) for x in (values if isinstance(values, list) else [values] * 3)]
    return a[0], a[1], a[2]


def preprocess(pixels: np.ndarray, c: Gemma3VisionConfig) -> np.ndarray:
    """uint8 [H, W, 3] -> patches [P * P, 3 * p * p] float32, each (channel, row, col) like SigLIP's conv."""
    S, p, P = c.image_size, c.patch_size, c.patches_per_side
    if pixels.shape[:2] != (S, S):
        pixels = resize_bilinear(pixels, S)
    scaled = (pixels.astype(np.float64) * c.rescale).astype(np.float32)  # transformers rescales in float64
    x = (scaled - np.asarray(c.mean, np.float32)) / np.asarray(c.std, np.float32)  # [S, S, 3]
    x = x.transpose(2, 0, 1).reshape(3, P, p, P, p).transpose(1, 3, 0, 2, 4)  # [P, P, 3, p, p]
    return np.ascontiguousarray(x.reshape(P * P, 3 * p * p), dtype=np.float32)


def resize_bilinear(pixels: np.ndarray, size: int) -> np.ndarray:
    """Pillow's bilinear resize of uint8 RGB to size x size (what transformers' Gemma 3 processor does)."""
    try:
        from PIL import Image as PILImage
    except ImportError as e:
        raise ModelError("resizing an image needs Pillow: pip install pillow") from e
    resized = PILImage.fromarray(np.ascontiguousarray(pixels), "RGB").resize((size, size), PILImage.Resampling.BILINEAR)
    return np.asarray(resized, dtype=np.uint8)


V = "vision_tower."
VL = V + "encoder.layers.{i}."
PLUS1 = "norm_plus_one"


def _patch_matrix() -> Transform:
    """SigLIP's patch convolution [C, 3, p, p] as the matrix [C, 3 * p * p] a linear layer applies."""
    return Transform(lambda a, spec: a[0].reshape(a[0].shape[0], -1), lambda s, spec: (s[0][0], int(np.prod(s[0][1:]))))


def _transposed() -> Transform:
    """The projector's [vision, text] matrix as the [text, vision] weight of a linear layer."""
    return Transform(lambda a, spec: np.ascontiguousarray(a[0].T), lambda s, spec: (s[0][1], s[0][0]))


HF_NAMES = NameTable(
    "gemma3 vision",
    (
        rule(V + "embeddings.patch_embedding.weight", "patch", "patch_matrix"),
        rule(V + "embeddings.patch_embedding.bias", "patch_bias"),
        rule(V + "embeddings.position_embedding.weight", "positions"),
        rule(V + "post_layernorm.weight", "post_norm"),
        rule(V + "post_layernorm.bias", "post_norm_bias"),
        *(rule(VL + f"{n}.{kind}", "layers.{i}." + n + ("_bias" if kind == "bias" else ""))
          for n in ("layer_norm1", "layer_norm2") for kind in ("weight", "bias")),
        *(rule(VL + f"self_attn.{p}_proj.{kind}", "layers.{i}." + p + ("_bias" if kind == "bias" else ""))
          for p in ("q", "k", "v", "out") for kind in ("weight", "bias")),
        *(rule(VL + f"mlp.{f}.{kind}", "layers.{i}." + f + ("_bias" if kind == "bias" else ""))
          for f in ("fc1", "fc2") for kind in ("weight", "bias")),
        rule(V + "head.{*}", None),  # SigLIP's pooling head: Gemma 3 reads the patch states
        rule("multi_modal_projector.mm_soft_emb_norm.weight", "mm_norm", PLUS1),
        rule("multi_modal_projector.mm_input_projection_weight", "mm_projection", "transposed"),
    ),
    aliases=(  # released checkpoints nest SigLIP in `vision_model`; transformers 5 may prefix `model.`
        ("model.vision_tower.vision_model.", V), ("vision_tower.vision_model.", V), ("model.vision_tower.", V),
        ("model.multi_modal_projector.", "multi_modal_projector."),
    ),
    transforms=(("patch_matrix", _patch_matrix()), ("transposed", _transposed()),
                (PLUS1, elementwise(lambda a: a + np.float32(1.0)))),
)
PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def weight_shapes(c: Gemma3VisionConfig) -> dict[str, tuple[int, ...]]:
    """Every canonical weight of the tower and projector, with its shape."""
    C, F, p = c.hidden_size, c.intermediate_size, c.patch_size
    out: dict[str, tuple[int, ...]] = {"patch": (C, 3 * p * p), "patch_bias": (C,),
                                       "positions": (c.patches_per_side**2, C)}
    for i in range(c.num_layers):
        L = f"layers.{i}."
        out |= {L + "layer_norm1": (C,), L + "layer_norm1_bias": (C,)}
        out |= {L + n: (C, C) for n in ("q", "k", "v", "out")} | {L + n + "_bias": (C,) for n in ("q", "k", "v", "out")}
        out |= {L + "layer_norm2": (C,), L + "layer_norm2_bias": (C,)}
        out |= {L + "fc1": (F, C), L + "fc1_bias": (F,), L + "fc2": (C, F), L + "fc2_bias": (C,)}
    return out | {"post_norm": (C,), "post_norm_bias": (C,), "mm_norm": (C,), "mm_projection": (c.text_hidden_size, C)}


def vision_weights(folder: Path, spec: ModelSpec, c: Gemma3VisionConfig) -> WeightSet:
    """The tower's and projector's weights in `folder`'s safetensors, unread (text weights are left alone)."""
    from twinfer.runtime.loaders.hf import stored_tensors

    stored = {n: t for n, t in stored_tensors(folder).items() if n.startswith(PREFIXES)}
    return map_weights(spec, HF_NAMES, stored, str(folder), weight_shapes(c))


class Gemma3Vision:
    """Gemma 3's `VisionTower` over one backend's Ops: `weights` are that backend's arrays."""

    bidirectional = True

    def __init__(self, config: Gemma3VisionConfig, ops: Ops, weights: dict[str, Array], newlines: dict[int, int],
                 wrap: list[int]):
        """`newlines`: token id -> the newline run it stands for; `wrap`: the ids of "\\n\\n"."""
        self.config = config
        self.ops = ops
        self.weights = weights
        self.newlines = newlines
        self.wrap = wrap
        self._encode_newlines = _newline_encoder(newlines)

    def expand(self, tokens: list[int], images: list[Image]) -> tuple[list[int], list[ImageSpan]]:
        c = self.config
        markers = [i for i, t in enumerate(tokens) if t == c.boi_id]
        if len(markers) != len(images):
            raise ValueError(f"the prompt has {len(markers)} image markers (<start_of_image>) for {len(images)} "
                             "images; give one image per marker")
        block = [*self.wrap, c.boi_id, *[c.image_token_id] * c.mm_tokens_per_image, c.eoi_id, *self.wrap]
        out: list[int] = []
        inserted: list[bool] = []
        prev = 0
        for at in [*markers, len(tokens)]:
            out += tokens[prev:at]
            inserted += [False] * (at - prev)
            if at < len(tokens):
                out += block
                inserted += [True] * len(block)
            prev = at + 1
        out = merge_newlines(out, inserted, self.newlines, self._encode_newlines)
        starts = [i + 1 for i, t in enumerate(out) if t == c.boi_id]
        return out, [ImageSpan(s, c.mm_tokens_per_image, im) for s, im in zip(starts, images, strict=True)]

    def encode(self, image: Image) -> Array:
        patches = self.ops.weight("pixels", preprocess(image.pixels, self.config))
        return self.forward(patches)

    def forward(self, patches: Array) -> Array:
        """[patches, 3 * p * p] -> [mm_tokens_per_image, text hidden]."""
        ops, w, c = self.ops, self.weights, self.config
        eps = c.layer_norm_eps
        x = ops.linear(patches, w["patch"], w["patch_bias"]) + w["positions"]
        for i in range(c.num_layers):
            L = f"layers.{i}."
            x = x + self._attention(L, ops.layer_norm(x, w[L + "layer_norm1"], w[L + "layer_norm1_bias"], eps))
            h = ops.layer_norm(x, w[L + "layer_norm2"], w[L + "layer_norm2_bias"], eps)
            h = ops.act(ops.linear(h, w[L + "fc1"], w[L + "fc1_bias"]), "gelu_tanh")
            x = x + ops.linear(h, w[L + "fc2"], w[L + "fc2_bias"])
        x = ops.layer_norm(x, w["post_norm"], w["post_norm_bias"], eps)
        return self._project(x)

    def _attention(self, L: str, h: Array) -> Array:
        ops, w, c = self.ops, self.weights, self.config
        T, H, D = h.shape[0], c.num_heads, c.head_dim
        q, k, v = (ops.linear(h, w[L + n], w[L + n + "_bias"]).reshape(T, H, D) for n in ("q", "k", "v"))
        o = ops.encoder_attention(q, k, v, D**-0.5)
        return ops.linear(o.reshape(T, H * D), w[L + "out"], w[L + "out_bias"])

    def _project(self, x: Array) -> Array:
        """Average-pool the patch grid to the image tokens, soft-embedding RMSNorm, project to the text width."""
        c, ops = self.config, self.ops
        t, k = c.tokens_per_side, c.pool
        grid = x.reshape(t, k, t, k, c.hidden_size)  # (token row, patch row in it, token col, patch col in it)
        pooled = grid[:, 0, :, 0]
        for i in range(k):
            for j in range(k):
                if i or j:
                    pooled = pooled + grid[:, i, :, j]
        pooled = (pooled * (1.0 / (k * k))).reshape(t * t, c.hidden_size)
        normed = ops.rms_norm(pooled, self.weights["mm_norm"], c.layer_norm_eps)
        return ops.linear(normed, self.weights["mm_projection"])

    def weight_bytes(self) -> int:
        return sum(int(a.nbytes) for a in self.weights.values())


def _newline_encoder(newlines: dict[int, int]) -> Any:
    """n -> the ids of a run of n newlines: the longest single tokens first (as a BPE vocabulary merges)."""
    by_length = sorted(((n, t) for t, n in newlines.items()), reverse=True)

    def encode(n: int) -> list[int]:
        out: list[int] = []
        for length, token in by_length:
            while n >= length:
                out.append(token)
                n -= length
        return out

    return encode


def open_gemma3_vision(folder: Path, config: dict[str, Any], spec: ModelSpec, ops: Ops) -> Gemma3Vision | None:
    """The tower of the checkpoint in `folder` (`config`: its config.json) over `ops`; None: it has none."""
    c = read_vision_config(folder, config)
    if c is None:
        return None
    if c.text_hidden_size != spec.hidden_size or max(c.boi_id, c.eoi_id, c.image_token_id) >= spec.vocab_size:
        raise ModelError(f"{folder}: the vision projector's width {c.text_hidden_size} or its image token ids do "
                         f"not fit the language model ({spec.hidden_size} wide, {spec.vocab_size} tokens)")
    from twinfer.runtime.tokenizer import load_tokenizer

    tok = load_tokenizer(folder)
    newlines = {}
    for n in range(1, MAX_NEWLINES):
        ids = tok.encode("\n" * n, add_special_tokens=False)
        if len(ids) == 1:
            newlines[ids[0]] = n
    wrap = tok.encode("\n\n", add_special_tokens=False)
    ws = vision_weights(folder, spec, c)
    weights = {name: ops.weight(name, ws.load(name)) for name in ws.names()}
    return Gemma3Vision(c, ops, weights, newlines, wrap)


def merge_newlines(ids: list[int], inserted: list[bool], newlines: dict[int, int],
                   encode: Callable[[int], list[int]]) -> list[int]:
    """Newline runs an expansion touched, re-tokenized whole (`encode(count)`), as the processor tokenizes
    expanded text; `newlines` maps each newline token to how many newlines it is."""
    out: list[int] = []
    i = 0
    while i < len(ids):
        j = i
        while j < len(ids) and ids[j] in newlines:
            j += 1
        if j == i:
            out.append(ids[i])
            i += 1
            continue
        out += encode(sum(newlines[t] for t in ids[i:j])) if any(inserted[i:j]) else ids[i:j]
        i = j
    return out
