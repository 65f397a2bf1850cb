"""ModelProfile: a model's parameters counted by component (formats.COMPONENTS), from a ModelSpec, a
parameter count, or a GGUF; components are what a mix prices and a step reads differently."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from twinfer.planners.formats import COMPONENTS, FORMATS, LOSSLESS, Mix, written_format
from twinfer.planners.vision import VisionProfile
from twinfer.runtime.errors import PlanError
from twinfer.runtime.spec import FULL, LINEAR, SLIDING, ModelSpec, MoESpec

ROUTING_LOCALITY = 0.8

# A requantized tensor adds REQUANT_KL_FACTOR times its target format's table KL (fit and held-out
# rows: docs/quantization.md, "`--memory-budget` on the default model"); likely high for large models
REQUANT_KL_FACTOR = 35.0
# Embedding and output weights add EMBED_KL_WEIGHT of a projection's KL: their error enters the logits
# once and linearly (fit: docs/quantization.md, "The embedding is the lever")
EMBED_KL_WEIGHT = 0.22


@dataclass(frozen=True)
class ModelProfile:
    """Everything the memory and cost models need about one model: `params` per component, one routed
    expert's `expert_params`, the published mix (`native`), a GGUF's exact one (`stored`) and the vision
    encoder with the images each request brings (`vision`, outside `params`)."""

    name: str
    spec: ModelSpec
    params: tuple[tuple[str, float], ...]
    native: str = "bf16"
    stored: Mix | None = None
    source: str = "catalog"
    notes: tuple[str, ...] = field(default_factory=tuple)
    vision: VisionProfile | None = None

    def count(self, component: str) -> float:
        return dict(self.params).get(component, 0.0)

    @property
    def total_params(self) -> float:
        return sum(v for _, v in self.params)

    @property
    def image_tokens(self) -> int:
        """Context tokens each request's images take (0 for a text-only model or plan)."""
        return self.vision.image_tokens if self.vision else 0

    def with_images(self, images: int | None) -> ModelProfile:
        """This model planned for `images` per request (None: its default, one for a vision model)."""
        if images is None:
            return self
        if self.vision is None:
            if images:
                raise PlanError(f"--images {images}: {self.name} has no vision encoder (a checkpoint with "
                                "vision_tower tensors, or a GGUF with an mmproj file beside it)")
            return self
        return replace(self, vision=self.vision.with_images(images))

    def vision_bytes(self, mix: Mix, engine: str) -> float:
        """The vision encoder's bytes as `engine` running `mix` holds them (0 without one)."""
        return self.vision.weight_bytes(mix.default, engine) if self.vision else 0.0

    @property
    def moe(self) -> MoESpec | None:
        return self.spec.moe

    @property
    def moe_layers(self) -> int:
        return sum(1 for i in range(self.spec.num_layers) if self.spec.is_moe_layer(i))

    @property
    def expert_params(self) -> float:
        """One routed expert of one layer (gate, up and down)."""
        if not self.moe or not self.moe_layers:
            return 0.0
        return (self.count("experts") + self.count("experts_down")) / (self.moe.num_experts * self.moe_layers)

    @property
    def routed_params(self) -> float:
        return self.count("experts") + self.count("experts_down")

    @property
    def dense_params(self) -> float:
        """Weights every token touches, except the embedding table (read one row per token)."""
        return self.total_params - self.routed_params - self.count("embed")

    @property
    def tied(self) -> bool:
        """The output projection reuses the embedding table, so every step reads it whole."""
        return self.count("lm_head") == 0

    @property
    def active_params(self) -> float:
        """Parameters one token multiplies with: the dense part, the output head, top_k experts per layer."""
        k = self.moe.top_k if self.moe else 0
        head = self.count("embed") if self.tied else 0.0
        return self.dense_params + head + k * self.moe_layers * self.expert_params

    def touched_experts(self, batch: float) -> float:
        """Expected distinct experts per MoE layer a step of `batch` tokens reads: B^ROUTING_LOCALITY
        independent top-k draws (docs/planner-accuracy.md)."""
        if not self.moe:
            return 0.0
        e, k = self.moe.num_experts, self.moe.top_k
        return e * (1.0 - (1.0 - k / e) ** (max(batch, 1.0) ** ROUTING_LOCALITY))

    def rows(self, component: str) -> tuple[tuple[int, float], ...]:
        """(row length, share of the component's weights) of its matrices: the input dim, llama.cpp's ne[0]."""
        return _row_lengths(self.spec, component)

    def split(self, mix: Mix, component: str) -> tuple[tuple[str, float], ...]:
        """(format, share) of `component` as stored under `mix`: for a mix llama.cpp's quantizer writes, a
        tied embedding takes the output's type and a K-quant on rows it cannot hold falls back (formats.py)."""
        if mix.exact:
            return mix.split(component)
        source = "lm_head" if (mix.writer == "llamacpp" and component == "embed" and self.tied
                               and not any(c == "embed" for c, _ in mix.parts)) else component
        out: dict[str, float] = {}
        for fmt, share in mix.split(source):
            for row, part in self.rows(component):
                name = written_format(fmt, row)
                out[name] = out.get(name, 0.0) + share * part
        return tuple(out.items())

    def bits(self, mix: Mix, component: str) -> float:
        """Stored bits per weight of `component` under `mix` (a GGUF's measured ones when `mix` is the file)."""
        exact = dict(mix.exact).get(component)
        if exact is not None:
            return exact
        return sum(FORMATS[f].bits * share for f, share in self.split(mix, component))

    def bytes_of(self, mix: Mix, component: str) -> float:
        return self.count(component) * self.bits(mix, component) / 8.0

    def weight_bytes(self, mix: Mix) -> float:
        return sum(self.bytes_of(mix, c) for c in COMPONENTS)

    def step_bytes(self, mix: Mix, touched_experts: float) -> float:
        """Weight bytes one decode step reads when `touched_experts` experts per MoE layer are used."""
        dense = sum(self.bytes_of(mix, c) for c in COMPONENTS if c not in ("embed", "experts", "experts_down"))
        head = self.bytes_of(mix, "embed") if self.tied else 0.0
        return dense + head + touched_experts * self.moe_layers * self.expert_bytes(mix)

    def is_reference(self, mix: Mix) -> bool:
        """The published checkpoint (or the file itself): what fidelity is measured against."""
        return mix is self.stored or (self.stored is None and mix.name == self.native)

    def mix_kl(self, mix: Mix) -> float:
        """Expected KL of `mix` against the reference weights, by component share; from a `stored` file
        only the weights `mix` retypes add error."""
        if self.is_reference(mix):
            return 0.0
        total = self.total_params or 1.0
        if self.stored is None:
            return sum(self.count(c) * share * FORMATS[f].kl for c in COMPONENTS
                       for f, share in self.split(mix, c)) / total
        return sum(self.count(c) * _requant_kl(self.split(self.stored, c), self.split(mix, c))
                   * (EMBED_KL_WEIGHT if c in ("embed", "lm_head") else 1.0) for c in COMPONENTS) / total

    def mix_tier(self, mix: Mix) -> int:
        """Fidelity tier: the lossiest format llama.cpp actually writes for its mixes, else the mix's default."""
        if self.is_reference(mix):
            return LOSSLESS
        if mix.writer != "llamacpp":
            return FORMATS[mix.default].tier
        return max(FORMATS[f].tier for c in COMPONENTS if self.count(c) for f, share in self.split(mix, c) if share)

    def expert_bytes(self, mix: Mix) -> float:
        """Bytes of one routed expert in one layer."""
        if not self.moe_layers or not self.moe:
            return 0.0
        routed = self.bytes_of(mix, "experts") + self.bytes_of(mix, "experts_down")
        return routed / (self.moe.num_experts * self.moe_layers)

    def attention_flops_per_token(self, context: int) -> float:
        """QK^T and PV multiply-adds of one decoded token against `context` cached tokens."""
        s = self.spec
        # absorbed MLA: scores over latent + rope, values over the latent
        per_head = 2 * s.mla.kv_lora_rank + s.mla.qk_rope_head_dim if s.mla else 2 * s.head_dim
        total = 0.0
        for layer in range(s.num_layers):
            window = s.window(layer)
            span = min(context, window) if window else context
            total += 2.0 * s.num_heads * per_head * span
        return total


def _requant_kl(source: tuple[tuple[str, float], ...], target: tuple[tuple[str, float], ...]) -> float:
    """Expected KL per weight of a component moved from `source` to `target` formats: shared shares add
    nothing, the rest their target's KL (x REQUANT_KL_FACTOR from a quantized source)."""
    src = dict(source)
    quantized = any(FORMATS[f].bits < 16 for f in src)
    factor = REQUANT_KL_FACTOR if quantized else 1.0
    return sum(max(0.0, share - src.get(f, 0.0)) * FORMATS[f].kl * factor for f, share in target)


def _row_lengths(s: ModelSpec, component: str) -> tuple[tuple[int, float], ...]:
    """Input dims (llama.cpp's ne[0]) of a component's matrices, with each one's share of its weights."""
    d = s.hidden_size
    if component == "attn_out":
        return ((s.num_heads * s.mla.v_head_dim if s.mla else s.q_size, 1.0),)
    if component in ("attn", "attn_v") and s.mla is not None:
        m = s.mla
        if component == "attn_v":  # half of kv_b, whose input is the latent
            return ((m.kv_lora_rank, 1.0),)
        attn, _, _ = _attention_params(s)
        q_b = m.q_lora_rank * s.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim) if m.q_lora_rank else 0
        kv_b = m.kv_lora_rank * s.num_heads * (m.qk_nope_head_dim + m.v_head_dim) / 2
        rows = ((d, 1.0 - (q_b + kv_b) / attn), (m.q_lora_rank or d, q_b / attn), (m.kv_lora_rank, kv_b / attn))
        return tuple(r for r in rows if r[1] > 0)
    if component == "mlp_down":
        return ((s.intermediate_size, 1.0),)
    if component == "experts_down" and s.moe is not None:
        return ((s.moe.expert_intermediate_size, 1.0),)
    if component == "shared" and s.moe is not None:  # gate and up read the hidden state, down the expert's
        return ((d, 2 / 3), (s.moe.shared_intermediate_size or s.moe.expert_intermediate_size, 1 / 3))
    return ((d, 1.0),)


def _attention_params(s: ModelSpec) -> tuple[float, float, float]:
    """(q and k projections, v projection, o projection) weights of one layer."""
    d = s.hidden_size
    if s.mla is not None:
        m = s.mla
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        q = d * m.q_lora_rank + m.q_lora_rank * s.num_heads * qk if m.q_lora_rank else d * s.num_heads * qk
        kv_a = d * (m.kv_lora_rank + m.qk_rope_head_dim)
        kv_b = m.kv_lora_rank * s.num_heads * (m.qk_nope_head_dim + m.v_head_dim)
        o = s.num_heads * m.v_head_dim * d
        return q + kv_a + kv_b / 2, kv_b / 2, o
    q = d * s.q_size
    kv = d * s.kv_size
    o = s.q_size * d
    bias = (s.q_size + 2 * s.kv_size) if s.attention_bias else 0
    return q + kv + bias, kv, o


def _linear_attention(s: ModelSpec, counts: dict[str, float], full: tuple[float, float, float]) -> None:
    """Trade each LINEAR layer's attention weights for its delta net's (q/k/v, a, b, conv and decay in attn,
    the gate z in attn_v, the output in attn_out); full layers' q_proj is twice as wide (their output gate)."""
    la, d = s.linear_attn, s.hidden_size
    assert la is not None
    linear = s.attention_types.count(LINEAR)
    counts["attn"] += linear * (d * (la.conv_dim + 2 * la.num_v_heads) + la.conv_dim * la.conv_kernel
                                + 2 * la.num_v_heads - full[0]) + (s.num_layers - linear) * d * s.q_size
    counts["attn_v"] += linear * (d * la.value_dim - full[1])
    counts["attn_out"] += linear * (la.value_dim * d - full[2])


def profile_from_spec(spec: ModelSpec, name: str = "", native: str = "bf16", source: str = "catalog",
                      notes: tuple[str, ...] = (), vision: VisionProfile | None = None) -> ModelProfile:
    """Count a spec's weights per component (norm and bias vectors included, rotary tables not)."""
    d, L = spec.hidden_size, spec.num_layers
    attn, attn_v, attn_out = _attention_params(spec)
    counts = {c: 0.0 for c in COMPONENTS}
    counts["embed"] = spec.vocab_size * d
    counts["lm_head"] = 0.0 if spec.tie_word_embeddings else spec.vocab_size * d
    counts["attn"] = attn * L
    if spec.linear_attn is not None:  # gated delta-net layers replace attention (qwen3_next, qwen3_5_moe)
        _linear_attention(spec, counts, (attn, attn_v, attn_out))
    if spec.dsa is not None and spec.mla is not None and spec.mla.q_lora_rank:  # sparse attention's indexers
        dsa = spec.dsa  # q from the q latent, a key with its LayerNorm, per-head weights
        per = dsa.n_heads * dsa.head_dim * spec.mla.q_lora_rank + (d + 2) * dsa.head_dim + dsa.n_heads * d
        counts["attn"] += per * sum(map(dsa.has_indexer, range(L)))
    counts["attn_v"] += attn_v * L
    counts["attn_out"] += attn_out * L
    counts["norm"] = (2 * d + (2 * spec.head_dim if spec.qk_norm else 0)) * L + d
    moe = spec.moe
    for layer in range(L):
        if spec.is_moe_layer(layer):
            assert moe is not None
            e = moe.num_experts * d * moe.expert_intermediate_size
            counts["experts"] += 2 * e
            counts["experts_down"] += e
            shared_i = moe.shared_intermediate_size or moe.expert_intermediate_size
            counts["shared"] += 3 * moe.num_shared_experts * d * shared_i
            counts["router"] += moe.num_experts * d
        else:
            counts["mlp"] += 2 * d * spec.intermediate_size
            counts["mlp_down"] += d * spec.intermediate_size
    return ModelProfile(
        name=name or spec.name or spec.model_type, spec=spec, params=tuple(counts.items()), native=native,
        source=source, notes=notes, vision=vision,
    )


def parametric(params: float, active: float | None = None, layers: int | None = None,
               experts: int | None = None, top_k: int | None = None, name: str = "") -> ModelProfile:
    """A model known only by its parameter counts (`--params 2.8T --active-params 60B`); the assumed
    shape (Llama-3-like width, GQA 8x128, Kimi-K2-like experts) is stated in the profile's notes."""
    if params <= 0:
        raise PlanError("--params must be positive")
    active = params if active is None else active
    if not 0 < active <= params:
        raise PlanError(f"--active-params ({active:.3g}) must be positive and at most --params ({params:.3g})")
    is_moe = active < params * 0.999
    vocab = 163840
    e = experts or 384
    k = top_k or max(1, min(e // 2, round(e * 0.75 * active / params)))  # experts ~3/4 of active
    if is_moe and not 0 < k < e:
        raise PlanError(f"--top-k ({k}) must be between 1 and the expert count ({e})")
    fixed = layers is not None
    if layers is None:  # active non-embedding params ~ 12 d^2 L with d = 128 L
        layers = max(2, round((active * 128 / 12) ** (1 / 3) / 128))
    while True:
        hidden = max(1024, round(layers / 8) * 1024)  # a multiple of 8 heads of 128
        heads, kv_heads = hidden // 128, 8
        table = vocab * hidden
        attn = layers * (2 * hidden * hidden + 2 * hidden * kv_heads * 128)
        if is_moe:  # P - A = table + X(1 - k/E); the rest of A is shared experts
            routed = (params - active - table) / (1 - k / e)
            rest = active - attn - table - routed * k / e
        else:
            routed, rest = 0.0, params - attn - 2 * table
        if rest >= 0 or layers <= 2 or fixed:
            break
        layers -= 1  # the user's counts leave no room for this much attention: a narrower model
    if rest < 0:
        raise PlanError("--params/--active-params/--experts/--top-k are inconsistent: the routed experts "
                        "alone exceed the active parameters")
    moe = None
    if is_moe:
        shared_i = int(rest / (3 * hidden * layers))
        expert_i = max(1, round(routed / (3 * hidden * e * layers)))
        moe = MoESpec(num_experts=e, top_k=k, expert_intermediate_size=expert_i,
                      num_shared_experts=1 if shared_i else 0, shared_intermediate_size=shared_i)
        inter = expert_i
    else:
        inter = max(1, round(rest / (3 * hidden * layers)))
    spec = ModelSpec(
        model_type="parametric", name=name or f"parametric {params:.3g}", vocab_size=vocab, hidden_size=hidden,
        num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=128, intermediate_size=inter,
        max_position=131072, moe=moe,
    )
    notes = (f"parametric model: {layers} layers, hidden {hidden}, GQA 8x128 KV heads assumed"
             + (f", {moe.num_experts} experts top-{moe.top_k}" if moe else ""),)
    return profile_from_spec(spec, name=spec.name, source="parametric", notes=notes)


def sliding_layers(spec: ModelSpec) -> int:
    return sum(1 for t in spec.attention_types if t == SLIDING)


def full_layers(spec: ModelSpec) -> int:
    return sum(1 for t in spec.attention_types if t == FULL)


def round_up(x: float, multiple: int) -> int:
    return int(math.ceil(x / multiple) * multiple)
