"""Kimi K2.5's vision tower (MoonViT) and patch-merger projector over `Ops`, as transformers'
`Kimi_K25VisionModel` + `Kimi_K25MultimodalProjection` compute them for one image (a single frame adds
the temporal table's zero row, so it is left out). `<|media_pad|>` marks an image; `expand` repeats it
once per merged patch (docs/images.md, "Kimi K2.5")."""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from twinfer.runtime.errors import ModelError
from twinfer.runtime.loaders.hf import stored_tensors
from twinfer.runtime.loaders.names import NameTable, map_weights, rule
from twinfer.runtime.loaders.weights import Transform, WeightSet
from twinfer.runtime.ops import Array, Ops
from twinfer.runtime.spec import ModelSpec
from twinfer.runtime.vision import Image, ImageSpan
from twinfer.runtime.vision.kimi_k25_image import (
    ImageSettings,
    patches,
    position_embedding,
    rope_tables,
    rotate_half_matrix,
)

TEXT_PREFIXES = ("language_model.", "model.language_model.", "lm_head.")  # the text loader's weights
LN_EPS = 1e-5  # MoonViT's LayerNorms (fixed in transformers' modeling code)


@dataclass(frozen=True)
class KimiVisionConfig:
    """The tower's shape (config.json `vision_config` and the wrapper's projector keys) and the image
    processor's settings."""

    hidden: int
    layers: int
    heads: int
    intermediate: int
    pos_side: int  # the learned position grid is pos_side x pos_side
    merge: int
    rope_theta: float
    text_hidden: int
    projection_eps: float
    image_token_id: int
    image: ImageSettings

    def __post_init__(self) -> None:
        if self.hidden % self.heads or (self.hidden // self.heads) % 4:
            raise ModelError(f"kimi_k25 vision: hidden size {self.hidden} over {self.heads} heads needs a head "
                             "size divisible by 4 (axial rope turns two axes in each half)")
        if self.merge != self.image.merge:
            raise ModelError(f"kimi_k25 vision: merge kernel {self.merge} differs from the image processor's "
                             f"merge_size {self.image.merge}; fix config.json or the processor config")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def vision_config(config: dict[str, Any], processor: dict[str, Any]) -> KimiVisionConfig:
    """From config.json (transformers 5 keys, or Moonshot's published `vt_*` / `init_pos_emb_*` keys) and
    the image processor's settings (`read_processor`)."""
    v, text = config.get("vision_config"), config.get("text_config")
    if not isinstance(v, dict) or not isinstance(text, dict):
        raise ModelError("config.json of a kimi_k25 model needs 'vision_config' and 'text_config' objects")
    eps: Any = config.get("projection_layer_norm_eps", v.get("projector_ln_eps", 1e-5))

    def key(*names: str, default: Any = None) -> Any:
        for n in names:
            if n in v:
                return v[n]
        if default is None:
            raise ModelError(f"config.json vision_config has no {names[0]!r}")
        return default

    merge = key("merge_kernel_size", default=(2, 2))
    if merge[0] != merge[1]:
        raise ModelError(f"kimi_k25 vision: a non-square merge kernel {merge} is not supported")
    act = key("hidden_act", default="gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ModelError(f"kimi_k25 vision: hidden_act {act!r} is not supported (gelu_pytorch_tanh is)")
    height, width = key("pos_emb_height", "init_pos_emb_height", default=64), key(
        "pos_emb_width", "init_pos_emb_width", default=64)
    if height != width:
        raise ModelError(f"kimi_k25 vision: a {height} x {width} position grid is not square")
    rope = v.get("rope_parameters") or {}
    return KimiVisionConfig(
        hidden=key("hidden_size", "vt_hidden_size"), layers=key("num_hidden_layers", "vt_num_hidden_layers"),
        heads=key("num_attention_heads", "vt_num_attention_heads"),
        intermediate=key("intermediate_size", "vt_intermediate_size"), pos_side=height, merge=merge[0],
        rope_theta=float(rope.get("rope_theta", 10000.0)), text_hidden=text["hidden_size"],
        projection_eps=float(eps),
        image_token_id=int(config.get("image_token_id", config.get("media_placeholder_token_id", 163605))),
        image=image_settings(processor, patch=key("patch_size", default=14)),
    )


def read_processor(folder: Path) -> dict[str, Any]:
    """The image processor's settings: transformers 5 writes them under `image_processor` in
    processor_config.json; released checkpoints carry preprocessor_config.json."""
    for name in ("processor_config.json", "preprocessor_config.json"):
        path = folder / name
        if path.is_file():
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as e:
                raise ModelError(f"cannot read {path}: {e}; fix or re-download it") from e
            settings = data.get("image_processor", data)
            return {**settings.get("media_proc_cfg", {}), **settings}
    return {}


def image_settings(p: dict[str, Any], patch: int) -> ImageSettings:
    """transformers' keys (`size.max_height`, `max_patches`, `merge_size`) or the published
    `media_proc_cfg` ones (`patch_limit_on_one_side`, `in_patch_limit`, `merge_kernel_size`)."""
    d = ImageSettings()
    size = p.get("size") or {}
    merge = p.get("merge_size", p.get("merge_kernel_size", d.merge))
    return ImageSettings(
        patch=int(p.get("patch_size", patch)), merge=int(merge[0] if isinstance(merge, list) else merge),
        max_side=int(size.get("max_height", p.get("patch_limit_on_one_side", d.max_side))),
        max_patches=int(p.get("max_patches", p.get("in_patch_limit", d.max_patches))),
        mean=tuple(p.get("image_mean", d.mean)), std=tuple(p.get("image_std", d.std)),  # type: ignore[arg-type]
        rescale=float(p.get("rescale_factor", d.rescale)),
    )


def vision_names(cfg: KimiVisionConfig) -> NameTable:
    """The tower's tensors as Moonshot publishes them (fused `wqkv` with each head's rope rows
    interleaved; transformers' save writes this too) and as transformers 5 holds them in memory."""
    L = "vision_tower.encoder.blocks.{i}."
    M = "vision_tower.layers.{i}."
    rules = [rule("vision_tower.patch_embed.proj.weight", "patch", "flatten_patch"),
             rule("vision_tower.patch_embed.proj.bias", "patch_bias"),
             rule("vision_tower.patch_embed.pos_emb.weight", "pos"),
             rule("vision_tower.patch_embed.pos_emb.position_embeddings", "pos")]
    for third, part in enumerate("qkv"):
        rules += [rule(L + "wqkv.weight", f"layers.{{i}}.{part}", f"qkv_{third}"),
                  rule(L + "wqkv.bias", f"layers.{{i}}.{part}_bias", f"qkv_{third}"),
                  rule(M + f"attn.{part}_proj.weight", f"layers.{{i}}.{part}"),
                  rule(M + f"attn.{part}_proj.bias", f"layers.{{i}}.{part}_bias")]
    pairs = (("norm0", "norm1", "norm1"), ("norm1", "norm2", "norm2"), ("wo", "attn.proj", "o"),
             ("mlp.fc0", "mlp.fc1", "fc1"), ("mlp.fc1", "mlp.fc2", "fc2"),
             ("encoder.final_layernorm", "final_layernorm", "final_norm"),
             ("pre_norm", "pre_norm", "proj_norm"), ("proj.0", "in_proj", "proj_in"),
             ("proj.2", "out_proj", "proj_out"))
    for published, held, target in pairs:
        if target == "final_norm":
            sources = ("vision_tower." + published, "vision_tower." + held)
        elif target.startswith("proj"):
            sources = ("mm_projector." + published, "mm_projector." + held)
        else:
            sources, target = (L + published, M + held), "layers.{i}." + target
        for s in dict.fromkeys(sources):
            rules += [rule(s + ".weight", target), rule(s + ".bias", target + "_bias")]
    aliases = (("model.vision_tower.", "vision_tower."), ("model.mm_projector.", "mm_projector."),
               ("vision_tower.encoder.patch_embed.", "vision_tower.patch_embed."))
    return NameTable("kimi_k25_vision", tuple(rules), aliases=aliases, transforms=_transforms(cfg))


def _transforms(cfg: KimiVisionConfig) -> tuple[tuple[str, Transform], ...]:
    def flatten(a: list[np.ndarray], spec: ModelSpec) -> np.ndarray:
        return a[0].reshape(a[0].shape[0], -1)  # conv [C, 3, p, p] -> linear [C, 3 p p]

    def third(part: int) -> Transform:
        def apply(a: list[np.ndarray], spec: ModelSpec) -> np.ndarray:
            x = np.split(a[0], 3)[part]
            if part == 2:
                return x
            half = cfg.head_dim // 2  # published rows per head: (half, 2) interleaved -> (2, half)
            return x.reshape(cfg.heads, half, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)

        return Transform(apply, lambda s, spec: (s[0][0] // 3, *s[0][1:]), split=3)

    flat = Transform(flatten, lambda s, spec: (s[0][0], int(np.prod(s[0][1:]))))
    return (("flatten_patch", flat), *((f"qkv_{i}", third(i)) for i in range(3)))


def weight_shapes(cfg: KimiVisionConfig) -> dict[str, tuple[int, ...]]:
    C, F, p = cfg.hidden, cfg.intermediate, cfg.image.patch
    m2 = cfg.merge * cfg.merge
    shapes: dict[str, tuple[int, ...]] = {"patch": (C, 3 * p * p), "patch_bias": (C,),
                                          "pos": (cfg.pos_side, cfg.pos_side, C)}
    for i in range(cfg.layers):
        for name, shape in (("norm1", (C,)), ("norm2", (C,)), ("q", (C, C)), ("k", (C, C)), ("v", (C, C)),
                            ("o", (C, C)), ("fc1", (F, C)), ("fc2", (C, F))):
            shapes[f"layers.{i}.{name}"] = shape
            shapes[f"layers.{i}.{name}_bias"] = shape[:1]
    shapes |= {"final_norm": (C,), "final_norm_bias": (C,), "proj_norm": (C,), "proj_norm_bias": (C,),
               "proj_in": (m2 * C, m2 * C), "proj_in_bias": (m2 * C,),
               "proj_out": (cfg.text_hidden, m2 * C), "proj_out_bias": (cfg.text_hidden,)}
    return shapes


def load_weights(folder: Path, cfg: KimiVisionConfig, spec: ModelSpec) -> WeightSet:
    """The vision tower's and projector's tensors of a checkpoint folder (the text model's are skipped)."""
    stored = stored_tensors(folder)
    return map_weights(spec, vision_names(cfg), stored, str(folder), weight_shapes(cfg), skip=TEXT_PREFIXES)


class KimiVisionTower:
    """`VisionTower` for Kimi K2.5: images -> [tokens, text hidden] features on the runner's `ops`."""

    bidirectional = False  # the language model reads image tokens causally

    def __init__(self, cfg: KimiVisionConfig, ops: Ops, weights: WeightSet):
        self.cfg, self.ops = cfg, ops
        self.pos_grid = weights.load("pos")  # host copy: resampled per grid shape on the host
        self.w = {name: ops.weight(name, weights.load(name)) for name in weights.names() if name != "pos"}
        self.w["rotate_half"] = ops.weight("rotate_half", rotate_half_matrix(cfg.head_dim))
        self._tables: OrderedDict[tuple[int, int], tuple[Array, Array, Array]] = OrderedDict()

    def expand(self, tokens: list[int], images: list[Image]) -> tuple[list[int], list[ImageSpan]]:
        marker = self.cfg.image_token_id
        found = tokens.count(marker)
        if found != len(images):
            raise ValueError(f"the prompt has {found} image markers (token {marker}) for {len(images)} images")
        out: list[int] = []
        spans: list[ImageSpan] = []
        queue = iter(images)
        for t in tokens:
            if t != marker:
                out.append(t)
                continue
            image = next(queue)
            n = self.cfg.image.tokens(image.pixels.shape[0], image.pixels.shape[1])
            spans.append(ImageSpan(len(out), n, image))
            out += [marker] * n
        return out, spans

    def encode(self, image: Image) -> Array:
        x, (gh, gw) = patches(self.cfg.image, image.pixels)
        ops, w = self.ops, self.w
        pos, cos, sin = self._grid_tables(gh, gw)
        h = ops.linear(ops.weight("pixels", x), w["patch"], w["patch_bias"]) + pos
        for i in range(self.cfg.layers):
            h = self._layer(h, f"layers.{i}.", cos, sin)
        return self._project(ops.layer_norm(h, w["final_norm"], w["final_norm_bias"], LN_EPS))

    def weight_bytes(self) -> int:
        return int(self.pos_grid.nbytes) + sum(int(a.nbytes) for k, a in self.w.items() if k != "rotate_half")

    def _grid_tables(self, gh: int, gw: int) -> tuple[Array, Array, Array]:
        """Position rows and rope cos/sin for a grid shape; the last few shapes stay on the device."""
        key = (gh, gw)
        if key not in self._tables:
            cfg, ops = self.cfg, self.ops
            cos, sin = rope_tables(gh, gw, cfg.merge, cfg.head_dim, cfg.rope_theta)
            pos = position_embedding(self.pos_grid, gh, gw, cfg.merge)
            self._tables[key] = (ops.weight("pos", pos), ops.weight("rope_cos", cos), ops.weight("rope_sin", sin))
            if len(self._tables) > 8:
                self._tables.popitem(last=False)
        self._tables.move_to_end(key)
        return self._tables[key]

    def _layer(self, x: Array, p: str, cos: Array, sin: Array) -> Array:
        ops, w = self.ops, self.w
        h = ops.layer_norm(x, w[p + "norm1"], w[p + "norm1_bias"], LN_EPS)
        x = x + self._attention(h, p, cos, sin)
        h = ops.layer_norm(x, w[p + "norm2"], w[p + "norm2_bias"], LN_EPS)
        h = ops.act(ops.linear(h, w[p + "fc1"], w[p + "fc1_bias"]), "gelu_tanh")
        return x + ops.linear(h, w[p + "fc2"], w[p + "fc2_bias"])

    def _attention(self, h: Array, p: str, cos: Array, sin: Array) -> Array:
        ops, w, cfg = self.ops, self.w, self.cfg
        N, H, D = h.shape[0], cfg.heads, cfg.head_dim
        q, k, v = (ops.linear(h, w[p + n], w[p + n + "_bias"]).reshape(N, H, D) for n in ("q", "k", "v"))
        q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
        o = ops.encoder_attention(q, k, v, D**-0.5)  # [N, H, D]: every patch sees every patch
        return ops.linear(o.reshape(N, cfg.hidden), w[p + "o"], w[p + "o_bias"])

    def _rope(self, x: Array, cos: Array, sin: Array) -> Array:
        N, H, D = x.shape
        turned = self.ops.linear(x.reshape(N * H, D), self.w["rotate_half"]).reshape(N, H, D)
        return x * cos + turned * sin

    def _project(self, h: Array) -> Array:
        """Patch merger: rows come in merge blocks, so a block's rows concatenate by a reshape."""
        ops, w = self.ops, self.w
        h = ops.layer_norm(h, w["proj_norm"], w["proj_norm_bias"], self.cfg.projection_eps)
        h = h.reshape(h.shape[0] // (self.cfg.merge**2), -1)
        h = ops.act(ops.linear(h, w["proj_in"], w["proj_in_bias"]), "gelu")
        return ops.linear(h, w["proj_out"], w["proj_out_bias"])


def open_kimi_vision(folder: Path, config: dict[str, Any], spec: ModelSpec, ops: Ops) -> KimiVisionTower | None:
    """The tower of the Kimi K2.5 checkpoint in `folder` (`config`: its config.json) over `ops`, its weights
    read one at a time onto the backend; None when the config names no vision tower or its image token
    lies outside the vocabulary (no prompt can mark an image: the model reads text only)."""
    if not isinstance(config.get("vision_config"), dict):
        return None
    cfg = vision_config(config, read_processor(folder))
    if cfg.image_token_id >= spec.vocab_size:
        return None
    if cfg.text_hidden != spec.hidden_size:
        raise ModelError(f"{folder}: the vision projector's width {cfg.text_hidden} does not fit the language "
                         f"model's {spec.hidden_size}; fix config.json's text_config")
    return KimiVisionTower(cfg, ops, load_weights(folder, cfg, spec))
