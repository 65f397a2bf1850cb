"""Weight-name tables: how each file format's tensor names become twinfer's canonical names.

A table is data: a list of `Rule(source, target, transform)`. `source` is a file tensor name with
`{i}` (layer), `{e}` (expert) and `{*}` (anything) placeholders; `target` is the canonical name with
`{i}`, or None to drop the tensor on purpose (a vision tower in a text-only load). `transform` names
an entry of `weights.TRANSFORMS`. Several rules may read the same source (a fused gate/up tensor).

Canonical names (matrices are [out, in] like torch's Linear):
  embed [V, C], norm [C], lm_head [V, C] (absent when tied)
  layers.{i}.attn_norm, q [H*D, C], k/v [Hkv*D, C], o [C, H*D], q_bias/k_bias/v_bias,
  q_norm/k_norm [D], post_attn_norm, mlp_norm (pre-FFN), post_mlp_norm,
  dense: gate/up [I, C], down [C, I]; MoE: router [E, C], experts.gate/up [E, I, C], experts.down [E, C, I]
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from twinfer.runtime.errors import WeightError
from twinfer.runtime.loaders.weights import TRANSFORMS, StoredTensor, WeightEntry, WeightSet
from twinfer.runtime.spec import ModelSpec


@dataclass(frozen=True)
class Rule:
    source: str
    target: str | None
    transform: str | None = None

    def __post_init__(self) -> None:
        if self.transform is not None and self.transform not in TRANSFORMS:
            raise ValueError(f"rule {self.source!r}: unknown transform {self.transform!r}")


@dataclass(frozen=True)
class NameTable:
    """The rules of one architecture in one file format.

    `aliases` rewrite source-name prefixes before matching (multimodal wrappers nest the text model);
    `layer_extras` are canonical per-layer weights beyond the common set; `optional` canonical names
    may be absent.
    """

    name: str
    rules: tuple[Rule, ...]
    aliases: tuple[tuple[str, str], ...] = ()
    layer_extras: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()


def _r(source: str, target: str | None, transform: str | None = None) -> Rule:
    return Rule(source, target, transform)


# -- GGUF (llama.cpp names) ------------------------------------------------------------------------
_GGUF_COMMON = (
    _r("token_embd.weight", "embed"),
    _r("output_norm.weight", "norm"),
    _r("output.weight", "lm_head"),
    _r("blk.{i}.attn_norm.weight", "layers.{i}.attn_norm"),
    _r("blk.{i}.attn_v.weight", "layers.{i}.v"),
    _r("blk.{i}.attn_v.bias", "layers.{i}.v_bias"),
    _r("blk.{i}.attn_output.weight", "layers.{i}.o"),
    _r("blk.{i}.ffn_norm.weight", "layers.{i}.mlp_norm"),
    _r("blk.{i}.ffn_gate.weight", "layers.{i}.gate"),
    _r("blk.{i}.ffn_up.weight", "layers.{i}.up"),
    _r("blk.{i}.ffn_down.weight", "layers.{i}.down"),
)
_GGUF_QK = (
    _r("blk.{i}.attn_q.weight", "layers.{i}.q"),
    _r("blk.{i}.attn_k.weight", "layers.{i}.k"),
    _r("blk.{i}.attn_q.bias", "layers.{i}.q_bias"),
    _r("blk.{i}.attn_k.bias", "layers.{i}.k_bias"),
)
# llama.cpp's converter permutes llama Q/K rows for interleaved rope; undo it.
_GGUF_QK_PERMUTED = (
    _r("blk.{i}.attn_q.weight", "layers.{i}.q", "unpermute_q"),
    _r("blk.{i}.attn_k.weight", "layers.{i}.k", "unpermute_k"),
    _r("blk.{i}.attn_q.bias", "layers.{i}.q_bias", "unpermute_q"),
    _r("blk.{i}.attn_k.bias", "layers.{i}.k_bias", "unpermute_k"),
)
_GGUF_QK_NORM = (
    _r("blk.{i}.attn_q_norm.weight", "layers.{i}.q_norm"),
    _r("blk.{i}.attn_k_norm.weight", "layers.{i}.k_norm"),
)
_GGUF_MOE = (
    _r("blk.{i}.ffn_gate_inp.weight", "layers.{i}.router"),
    _r("blk.{i}.ffn_gate_exps.weight", "layers.{i}.experts.gate"),
    _r("blk.{i}.ffn_up_exps.weight", "layers.{i}.experts.up"),
    _r("blk.{i}.ffn_down_exps.weight", "layers.{i}.experts.down"),
    # GGUF files from before llama.cpp merged experts (2024) keep one tensor per expert.
    _r("blk.{i}.ffn_gate.{e}.weight", "layers.{i}.experts.gate", "stack_experts"),
    _r("blk.{i}.ffn_up.{e}.weight", "layers.{i}.experts.up", "stack_experts"),
    _r("blk.{i}.ffn_down.{e}.weight", "layers.{i}.experts.down", "stack_experts"),
)
_GEMMA3_SANDWICH = ("post_attn_norm", "post_mlp_norm")

_GGUF_LLAMA = NameTable(
    "llama GGUF",
    _GGUF_COMMON + _GGUF_QK_PERMUTED + _GGUF_MOE + (_r("rope_freqs.weight", "rope_freqs"),),
    optional=("rope_freqs",),  # llama 3.x rope frequency factors, precomputed by the converter
)
GGUF_TABLES: dict[str, NameTable] = {
    "llama": _GGUF_LLAMA,
    "mistral": _GGUF_LLAMA,
    "qwen2": NameTable("qwen2 GGUF", _GGUF_COMMON + _GGUF_QK),
    "qwen3": NameTable("qwen3 GGUF", _GGUF_COMMON + _GGUF_QK + _GGUF_QK_NORM),
    "qwen3moe": NameTable("qwen3moe GGUF", _GGUF_COMMON + _GGUF_QK + _GGUF_QK_NORM + _GGUF_MOE),
    "gemma3": NameTable(
        "gemma3 GGUF",
        _GGUF_COMMON
        + _GGUF_QK
        + _GGUF_QK_NORM
        + (
            _r("blk.{i}.post_attention_norm.weight", "layers.{i}.post_attn_norm"),
            _r("blk.{i}.post_ffw_norm.weight", "layers.{i}.post_mlp_norm"),
        ),
        layer_extras=_GEMMA3_SANDWICH,
    ),
}

# -- Hugging Face (transformers names) -------------------------------------------------------------
_L = "model.layers.{i}."
_HF_COMMON = (
    _r("model.embed_tokens.weight", "embed"),
    _r("model.norm.weight", "norm"),
    _r("lm_head.weight", "lm_head"),
    _r(_L + "input_layernorm.weight", "layers.{i}.attn_norm"),
    _r(_L + "post_attention_layernorm.weight", "layers.{i}.mlp_norm"),
    *(_r(_L + f"self_attn.{p}_proj.weight", "layers.{i}." + p) for p in "qkvo"),
    *(_r(_L + f"self_attn.{p}_proj.bias", f"layers.{{i}}.{p}_bias") for p in "qkv"),
    _r(_L + "self_attn.q_norm.weight", "layers.{i}.q_norm"),
    _r(_L + "self_attn.k_norm.weight", "layers.{i}.k_norm"),
    *(_r(_L + f"mlp.{p}_proj.weight", "layers.{i}." + p) for p in ("gate", "up", "down")),
    _r(_L + "self_attn.rotary_emb.inv_freq", None),  # a buffer old checkpoints saved
)
# transformers >= 5 holds experts fused in memory ([E, 2I, C] gate rows then up rows, [E, C, I]).
_HF_FUSED_EXPERTS = (
    _r(_L + "mlp.gate.weight", "layers.{i}.router"),
    _r(_L + "mlp.experts.gate_up_proj", "layers.{i}.experts.gate", "gate_half"),
    _r(_L + "mlp.experts.gate_up_proj", "layers.{i}.experts.up", "up_half"),
    _r(_L + "mlp.experts.down_proj", "layers.{i}.experts.down"),
)
_HF_QWEN3_MOE = NameTable(
    "qwen3_moe",
    _HF_COMMON
    + _HF_FUSED_EXPERTS
    + tuple(
        _r(_L + f"mlp.experts.{{e}}.{p}_proj.weight", f"layers.{{i}}.experts.{p}", "stack_experts")
        for p in ("gate", "up", "down")
    ),
)
_HF_MIXTRAL = NameTable(
    "mixtral",
    _HF_COMMON
    + _HF_FUSED_EXPERTS
    + (
        _r(_L + "block_sparse_moe.gate.weight", "layers.{i}.router"),
        _r(_L + "block_sparse_moe.experts.{e}.w1.weight", "layers.{i}.experts.gate", "stack_experts"),
        _r(_L + "block_sparse_moe.experts.{e}.w3.weight", "layers.{i}.experts.up", "stack_experts"),
        _r(_L + "block_sparse_moe.experts.{e}.w2.weight", "layers.{i}.experts.down", "stack_experts"),
    ),
)
_PLUS1 = "norm_plus_one"
_HF_GEMMA3 = NameTable(
    "gemma3",
    (
        _r("model.embed_tokens.weight", "embed"),
        _r("model.norm.weight", "norm", _PLUS1),
        _r("lm_head.weight", "lm_head"),
        _r(_L + "input_layernorm.weight", "layers.{i}.attn_norm", _PLUS1),
        _r(_L + "post_attention_layernorm.weight", "layers.{i}.post_attn_norm", _PLUS1),
        _r(_L + "pre_feedforward_layernorm.weight", "layers.{i}.mlp_norm", _PLUS1),
        _r(_L + "post_feedforward_layernorm.weight", "layers.{i}.post_mlp_norm", _PLUS1),
        _r(_L + "self_attn.q_norm.weight", "layers.{i}.q_norm", _PLUS1),
        _r(_L + "self_attn.k_norm.weight", "layers.{i}.k_norm", _PLUS1),
        *(_r(_L + f"self_attn.{p}_proj.weight", "layers.{i}." + p) for p in "qkvo"),
        *(_r(_L + f"mlp.{p}_proj.weight", "layers.{i}." + p) for p in ("gate", "up", "down")),
        # Gemma3ForConditionalGeneration checkpoints: the image side is not part of a text model.
        _r("vision_tower.{*}", None),
        _r("multi_modal_projector.{*}", None),
    ),
    aliases=(
        ("model.language_model.", "model."),  # transformers 5
        ("language_model.model.", "model."),  # transformers 4
        ("language_model.lm_head.", "lm_head."),
        ("model.vision_tower.", "vision_tower."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
    ),
    layer_extras=_GEMMA3_SANDWICH,
)
_HF_LLAMA = NameTable("llama", _HF_COMMON)
HF_TABLES: dict[str, NameTable] = {
    "gemma3": _HF_GEMMA3,
    "llama": _HF_LLAMA,
    "mistral": _HF_LLAMA,
    "qwen2": NameTable("qwen2", _HF_COMMON),
    "qwen3": NameTable("qwen3", _HF_COMMON),
    "qwen3_moe": _HF_QWEN3_MOE,
    "mixtral": _HF_MIXTRAL,
}


# -- expected names and shapes ---------------------------------------------------------------------
def expected_shapes(spec: ModelSpec, table: NameTable) -> dict[str, tuple[int, ...]]:
    """Every canonical weight `spec` needs, with its shape."""
    V, C, D = spec.vocab_size, spec.hidden_size, spec.head_dim
    Q, KV, FF = spec.q_size, spec.kv_size, spec.intermediate_size
    out: dict[str, tuple[int, ...]] = {"embed": (V, C), "norm": (C,)}
    if not spec.tie_word_embeddings:
        out["lm_head"] = (V, C)
    for i in range(spec.num_layers):
        p = f"layers.{i}."
        out |= {p + "attn_norm": (C,), p + "q": (Q, C), p + "k": (KV, C), p + "v": (KV, C), p + "o": (C, Q)}
        out[p + "mlp_norm"] = (C,)
        if spec.attention_bias:
            out |= {p + "q_bias": (Q,), p + "k_bias": (KV,), p + "v_bias": (KV,)}
        if spec.qk_norm:
            out |= {p + "q_norm": (D,), p + "k_norm": (D,)}
        for extra in table.layer_extras:
            out[p + extra] = (C,)
        if spec.moe is not None and spec.is_moe_layer(i):
            E, Ie = spec.moe.num_experts, spec.moe.expert_intermediate_size
            out[p + "router"] = (E, C)
            out |= {
                p + "experts.gate": (E, Ie, C),
                p + "experts.up": (E, Ie, C),
                p + "experts.down": (E, C, Ie),
            }
        else:
            out |= {p + "gate": (FF, C), p + "up": (FF, C), p + "down": (C, FF)}
    return out


# -- the mapper ------------------------------------------------------------------------------------
def _compile(pattern: str) -> re.Pattern[str]:
    parts = re.split(r"(\{i\}|\{e\}|\{\*\})", pattern)
    groups = {"{i}": r"(?P<i>\d+)", "{e}": r"(?P<e>\d+)", "{*}": r".*"}
    return re.compile("".join(groups.get(p, re.escape(p)) for p in parts))


def map_weights(
    spec: ModelSpec, table: NameTable, stored: Mapping[str, StoredTensor], origin: str
) -> WeightSet:
    """Build the WeightSet of `spec` from the file's tensors; raises WeightError naming the tensor
    when one matches no rule, a needed one is missing, or a shape disagrees with the spec."""
    compiled = [(_compile(rule.source), rule) for rule in table.rules]
    single: dict[str, WeightEntry] = {}
    experts: dict[tuple[str, str], dict[int, StoredTensor]] = {}  # (target, transform) -> e -> tensor
    for name, tensor in stored.items():
        key = _alias(name, table)
        hits = [(m, rule) for regex, rule in compiled if (m := regex.fullmatch(key))]
        if not hits:
            raise WeightError(f"unused tensor {name!r} in {origin}: no {table.name} weight maps to it")
        for m, rule in hits:
            if rule.target is None:
                continue
            target = rule.target.format(i=int(m["i"])) if "{i}" in rule.target else rule.target
            if rule.transform is not None and TRANSFORMS[rule.transform].many:
                experts.setdefault((target, rule.transform), {})[int(m["e"])] = tensor
            else:
                _add(single, target, WeightEntry((tensor,), rule.transform), origin)
    for (target, transform), by_expert in experts.items():
        _add(single, target, _stack(target, transform, by_expert, spec, origin), origin)
    return WeightSet(spec, _check(spec, table, single, origin))


def _alias(name: str, table: NameTable) -> str:
    for old, new in table.aliases:
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def _add(entries: dict[str, WeightEntry], target: str, entry: WeightEntry, origin: str) -> None:
    if target in entries:
        first, second = entries[target].sources[0].name, entry.sources[0].name
        raise WeightError(f"tensors {first!r} and {second!r} in {origin} both give {target!r}; remove one")
    entries[target] = entry


def _stack(
    target: str, transform: str, by_expert: dict[int, StoredTensor], spec: ModelSpec, origin: str
) -> WeightEntry:
    n = spec.moe.num_experts if spec.moe is not None else 0
    extra = sorted(e for e in by_expert if e >= n)
    if extra:
        raise WeightError(
            f"unused tensor {by_expert[extra[0]].name!r} in {origin}: the model has {n} experts"
        )
    missing = [e for e in range(n) if e not in by_expert]
    if missing:
        some = by_expert[min(by_expert)].name
        raise WeightError(
            f"missing tensor {target!r} expert {missing[0]} (expected next to {some!r}) in {origin}"
        )
    return WeightEntry(tuple(by_expert[e] for e in range(n)), transform)


def _check(
    spec: ModelSpec, table: NameTable, entries: dict[str, WeightEntry], origin: str
) -> dict[str, WeightEntry]:
    expected = expected_shapes(spec, table)
    out: dict[str, WeightEntry] = {}
    for target, entry in entries.items():
        if target not in expected:
            if target == "lm_head" and spec.tie_word_embeddings:
                continue  # a tied checkpoint that also saved the (identical) head
            if target not in table.optional:
                raise WeightError(
                    f"unused tensor {entry.sources[0].name!r} in {origin}: the model's config has no "
                    f"{target!r} weight"
                )
            out[target] = entry
            continue
        shape = entry.shape(spec)
        if shape != expected[target]:
            raise WeightError(
                f"tensor {entry.sources[0].name!r} in {origin} has shape {shape}, but the model's config "
                f"implies {expected[target]} for {target!r}"
            )
        out[target] = entry
    for target in expected:
        if target not in out:
            raise WeightError(
                f"missing tensor {target!r} (expected from {_source_hint(target, table)}) in {origin}"
            )
    return {name: out[name] for name in [*expected, *(n for n in out if n not in expected)]}


def _source_hint(target: str, table: NameTable) -> str:
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", target)
    layer, generic = (m[1], "layers.{i}." + m[2]) if m else (None, target)
    sources = [r.source for r in table.rules if r.target == generic]
    if layer is not None:
        sources = [s.replace("{i}", layer) for s in sources]
    return " or ".join(repr(s) for s in sources) or "no rule"
