"""Published architectures the planner knows by name, transcribed from each model's config.json, each
with its source repository and published weight format."""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from twinfer.planners.hardware import normalize
from twinfer.planners.model import ModelProfile, profile_from_spec
from twinfer.planners.vision import REFERENCE_IMAGE_SIDE, VisionProfile, merged_tokens
from twinfer.runtime.errors import PlanError
from twinfer.runtime.spec import FULL, SIGMOID, SLIDING, DSASpec, LinearAttnSpec, MLASpec, ModelSpec, MoESpec


@dataclass(frozen=True)
class Entry:
    name: str
    spec: ModelSpec
    repo: str  # Hugging Face repository of the config.json
    native: str = "bf16"
    aliases: tuple[str, ...] = ()
    vision: VisionProfile | None = None  # the checkpoint's vision encoder, counted from its vision_config

    def profile(self) -> ModelProfile:
        return profile_from_spec(self.spec, name=self.name, native=self.native, source=f"catalog ({self.repo})",
                                 vision=self.vision)


def _vit_layers(width: int, inter: int, layers: int) -> int:
    """A pre-norm ViT's blocks: two LayerNorms, q/k/v/o and a two-layer MLP, every linear with a bias."""
    return layers * (4 * width + 4 * (width * width + width) + 2 * width * inter + inter + width)


def _siglip(text_width: int) -> VisionProfile:
    """SigLIP so400m (no head) at 896 pixels and its projector: an RMSNorm and one matrix; 256 tokens."""
    w, grid = 1152, 896 // 14
    tower = 3 * 14 * 14 * w + w + grid * grid * w + _vit_layers(w, 4304, 27) + 2 * w
    return VisionProfile(tower + w + w * text_width, 256, source="SigLIP so400m encoder + projector")


def _qwen35_vision(text_width: int) -> VisionProfile:
    """Qwen3.5's tower (16-pixel patches over 2 frames, 2304 positions) and its 2 x 2 patch merger."""
    w, merged = 1152, 4 * 1152
    tower = 3 * 2 * 16 * 16 * w + w + 2304 * w + _vit_layers(w, 4304, 27)
    merger = 2 * w + merged * merged + merged + merged * text_width + text_width
    return VisionProfile(tower + merger, merged_tokens(REFERENCE_IMAGE_SIDE, 16, 2),
                         source=f"Qwen3.5 vision tower + merger; {REFERENCE_IMAGE_SIDE}-pixel images")


def _moonvit(text_width: int) -> VisionProfile:
    """Kimi K2.5's MoonViT (a 64 x 64 position grid) and its 2 x 2 merging two-layer projector."""
    w, merged = 1152, 4 * 1152
    tower = 3 * 14 * 14 * w + w + 64 * 64 * w + _vit_layers(w, 4304, 27) + 2 * w
    projector = 2 * w + merged * merged + merged + merged * text_width + text_width
    return VisionProfile(tower + projector, merged_tokens(REFERENCE_IMAGE_SIDE, 14, 2),
                         source=f"MoonViT encoder + projector; {REFERENCE_IMAGE_SIDE}-pixel images")


def _every(n: int, layers: int, offset: int = 0) -> tuple[str, ...]:
    """Gemma 3 / gpt-oss layer pattern: every n-th layer (1-based, after offset) is global."""
    return tuple(FULL if (i + 1 + offset) % n == 0 else SLIDING for i in range(layers))


@dataclass(frozen=True)
class _Dims:
    """A transformer's widths: hidden size, layers, attention heads, KV heads, MLP width."""

    d: int
    L: int
    h: int
    kv: int
    inter: int


def _llama(name: str, repo: str, dims: _Dims, vocab: int = 128256, theta: float = 500000.0,
           max_pos: int = 131072) -> Entry:
    d, L, h = dims.d, dims.L, dims.h
    spec = ModelSpec(model_type="llama", name=name, vocab_size=vocab, hidden_size=d, num_layers=L, num_heads=h,
                     num_kv_heads=dims.kv, head_dim=d // h, intermediate_size=dims.inter, max_position=max_pos,
                     rope_theta=theta, rms_norm_eps=1e-5)
    return Entry(name, spec, repo)


def _qwen3(name: str, d: int, L: int, h: int, kv: int, inter: int, tied: bool) -> Entry:
    spec = ModelSpec(model_type="qwen3", name=name, vocab_size=151936, hidden_size=d, num_layers=L, num_heads=h,
                     num_kv_heads=kv, head_dim=128, intermediate_size=inter, max_position=40960,
                     rope_theta=1e6, qk_norm=True, tie_word_embeddings=tied)
    return Entry(name, spec, f"Qwen/{name.replace('qwen3', 'Qwen3').replace('b', 'B')}")


def _qwen3_moe(name: str, repo: str, d: int, L: int, h: int, inter: int, moe_inter: int) -> Entry:
    spec = ModelSpec(model_type="qwen3_moe", name=name, vocab_size=151936, hidden_size=d, num_layers=L,
                     num_heads=h, num_kv_heads=4, head_dim=128, intermediate_size=inter, max_position=40960,
                     rope_theta=1e6, qk_norm=True,
                     moe=MoESpec(num_experts=128, top_k=8, expert_intermediate_size=moe_inter))
    return Entry(name, spec, repo)


_MLA = MLASpec(kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)


def _deepseek(name: str, repo: str, heads: int, experts: int, dense: int, vocab: int, max_pos: int) -> Entry:
    spec = ModelSpec(model_type="deepseek_v3", name=name, vocab_size=vocab, hidden_size=7168, num_layers=61,
                     num_heads=heads, num_kv_heads=heads, head_dim=192, intermediate_size=18432,
                     max_position=max_pos, mla=_MLA,
                     moe=MoESpec(num_experts=experts, top_k=8, expert_intermediate_size=2048, num_shared_experts=1,
                                 shared_intermediate_size=2048, first_dense_layers=dense,
                                 router_softmax_before_topk=False))
    return Entry(name, spec, repo, native="fp8")


def _glm(name: str, repo: str, d: int, L: int, inter: int, moe_inter: int, experts: int, dense: int) -> Entry:
    spec = ModelSpec(model_type="glm4_moe", name=name, vocab_size=151552, hidden_size=d, num_layers=L, num_heads=96,
                     num_kv_heads=8, head_dim=128, intermediate_size=inter, max_position=131072, rope_theta=1e6,
                     attention_bias=True, rms_norm_eps=1e-5,
                     moe=MoESpec(num_experts=experts, top_k=8, expert_intermediate_size=moe_inter,
                                 num_shared_experts=1, shared_intermediate_size=moe_inter, first_dense_layers=dense,
                                 router_softmax_before_topk=False))
    return Entry(name, spec, repo)


def _deepseek_v32(name: str, repo: str) -> Entry:
    """DeepSeek-V3's shape plus sparse attention's indexer (64 heads of 128, top 2048), cached per token."""
    v3 = _deepseek(name, repo, 128, 256, 3, 129280, 163840)
    return Entry(name, v3.spec.with_(model_type="deepseek_v32", dsa=DSASpec(n_heads=64, head_dim=128, top_k=2048)),
                 repo, native="fp8")


def _glm5(name: str, repo: str) -> Entry:
    spec = ModelSpec(model_type="glm_moe_dsa", name=name, vocab_size=154880, hidden_size=6144, num_layers=78,
                     num_heads=64, num_kv_heads=64, head_dim=256, intermediate_size=12288, max_position=202752,
                     rope_theta=1e6, rms_norm_eps=1e-5,
                     mla=MLASpec(kv_lora_rank=512, q_lora_rank=2048, qk_rope_head_dim=64, qk_nope_head_dim=192,
                                 v_head_dim=256),
                     dsa=DSASpec(n_heads=32, head_dim=128, top_k=2048),
                     moe=MoESpec(num_experts=256, top_k=8, expert_intermediate_size=2048, num_shared_experts=1,
                                 shared_intermediate_size=2048, first_dense_layers=3,
                                 router_softmax_before_topk=False))
    return Entry(name, spec, repo)


def _kimi_k25(name: str, repo: str) -> Entry:
    """Kimi K2.5's text_config: Kimi K2's shape at 256K context, its routed experts published in INT4."""
    k2 = _deepseek(name, repo, 64, 384, 1, 163840, 262144)
    return Entry(name, k2.spec, repo, native="int4-moe", vision=_moonvit(k2.spec.hidden_size))


def _minimax_m2(name: str, repo: str) -> Entry:
    spec = ModelSpec(model_type="minimax_m2", name=name, vocab_size=200064, hidden_size=3072, num_layers=62,
                     num_heads=48, num_kv_heads=8, head_dim=128, intermediate_size=1536, max_position=196608,
                     rope_theta=5e6, partial_rotary_factor=0.5, qk_norm=True,
                     moe=MoESpec(num_experts=256, top_k=8, expert_intermediate_size=1536,
                                 router_softmax_before_topk=False, scoring=SIGMOID, score_bias=True))
    return Entry(name, spec, repo, native="fp8")


def _qwen_hybrid(name: str, repo: str, model_type: str, d: int, L: int, h: int, experts: tuple[int, int, int],
                 v_heads: int, vocab: int) -> Entry:
    """Qwen3-Next / Qwen3.5 MoE: three gated delta-net layers then one gated full-attention layer, 2 KV heads of
    256 (a quarter rotated), 16 delta-net key heads of 128, `experts` (count, top-k, size) plus one shared
    expert of their width."""
    count, top_k, moe_inter = experts
    spec = ModelSpec(model_type=model_type, name=name, vocab_size=vocab, hidden_size=d, num_layers=L, num_heads=h,
                     num_kv_heads=2, head_dim=256, intermediate_size=moe_inter, max_position=262144, rope_theta=1e7,
                     partial_rotary_factor=0.25, qk_norm=True,
                     layer_types=tuple(FULL if (i + 1) % 4 == 0 else "linear_attention" for i in range(L)),
                     linear_attn=LinearAttnSpec(num_k_heads=16, num_v_heads=v_heads, head_k_dim=128, head_v_dim=128,
                                                conv_kernel=4),
                     moe=MoESpec(num_experts=count, top_k=top_k, expert_intermediate_size=moe_inter,
                                 num_shared_experts=1, shared_intermediate_size=moe_inter))
    return Entry(name, spec, repo, vision=_qwen35_vision(d) if model_type == "qwen3_5_moe" else None)


def _gpt_oss(name: str, L: int, experts: int) -> Entry:
    spec = ModelSpec(model_type="gpt_oss", name=name, vocab_size=201088, hidden_size=2880, num_layers=L,
                     num_heads=64, num_kv_heads=8, head_dim=64, intermediate_size=2880, max_position=131072,
                     rope_theta=150000.0, sliding_window=128, layer_types=_every(2, L), attention_bias=True,
                     rms_norm_eps=1e-5, attention_sinks=True,
                     moe=MoESpec(num_experts=experts, top_k=4, expert_intermediate_size=2880))
    return Entry(name, spec, f"openai/{name}", native="mxfp4-moe")


def _gemma3(name: str, repo: str, dims: _Dims, hd: int, vocab: int, window: int, scalar: float, max_pos: int,
            vision: bool = False) -> Entry:
    L = dims.L
    spec = ModelSpec(model_type="gemma3", name=name, vocab_size=vocab, hidden_size=dims.d, num_layers=L,
                     num_heads=dims.h, num_kv_heads=dims.kv, head_dim=hd, intermediate_size=dims.inter,
                     max_position=max_pos, rope_theta=1e6,
                     rope_local_theta=1e4, sliding_window=window, layer_types=_every(6, L), hidden_act="gelu_tanh",
                     tie_word_embeddings=True, qk_norm=True, embed_scale=True, query_pre_attn_scalar=scalar)
    return Entry(name, spec, repo, vision=_siglip(dims.d) if vision else None)


def _gemma4(name: str, repo: str, d: int, L: int, h: int, kv: int, global_kv: int, inter: int,
            experts: tuple[int, int, int] | None = None) -> Entry:
    """Gemma 4 (text_config of the published config.json): 5:1 sliding (256-wide heads, window 1024) and
    global layers (512-wide heads, `global_kv` KV heads, K = V); `experts` (count, top-k, size) run
    beside the dense MLP, which the spec counts as one shared expert of `inter`."""
    moe = None if experts is None else MoESpec(
        num_experts=experts[0], top_k=experts[1], expert_intermediate_size=experts[2], num_shared_experts=1,
        shared_intermediate_size=inter)
    spec = ModelSpec(model_type="gemma4", name=name, vocab_size=262144, hidden_size=d, num_layers=L, num_heads=h,
                     num_kv_heads=kv, head_dim=256, intermediate_size=inter, max_position=262144, rope_theta=1e6,
                     rope_local_theta=1e4, sliding_window=1024, layer_types=_every(6, L), hidden_act="gelu_tanh",
                     tie_word_embeddings=True, qk_norm=True, embed_scale=True, softmax_scale=1.0,
                     final_logit_softcap=30.0, global_head_dim=512, global_kv_heads=global_kv, moe=moe,
                     rope_scaling=(("factor", 1.0), ("partial_rotary_factor", 0.25), ("rope_type", "proportional")),
                     extra=(("per_layer_dim", 0), ("per_layer_vocab", 262144), ("k_eq_v", True),
                            ("double_wide_mlp", False)))
    return Entry(name, spec, repo)


ENTRIES: list[Entry] = [
    _llama("llama-2-7b", "meta-llama/Llama-2-7b-hf", _Dims(4096, 32, 32, 32, 11008), vocab=32000, theta=1e4, max_pos=4096),
    _llama("llama-3.1-8b", "meta-llama/Llama-3.1-8B", _Dims(4096, 32, 32, 8, 14336)),
    _llama("llama-3.1-70b", "meta-llama/Llama-3.1-70B", _Dims(8192, 80, 64, 8, 28672)),
    _llama("llama-3.1-405b", "meta-llama/Llama-3.1-405B", _Dims(16384, 126, 128, 8, 53248)),
    _qwen3("qwen3-0.6b", 1024, 28, 16, 8, 3072, tied=True),
    _qwen3("qwen3-1.7b", 2048, 28, 16, 8, 6144, tied=True),
    _qwen3("qwen3-4b", 2560, 36, 32, 8, 9728, tied=True),
    _qwen3("qwen3-8b", 4096, 36, 32, 8, 12288, tied=False),
    _qwen3("qwen3-14b", 5120, 40, 40, 8, 17408, tied=False),
    _qwen3("qwen3-32b", 5120, 64, 64, 8, 25600, tied=False),
    _qwen3_moe("qwen3-30b-a3b", "Qwen/Qwen3-30B-A3B", 2048, 48, 32, 6144, 768),
    _qwen3_moe("qwen3-235b-a22b", "Qwen/Qwen3-235B-A22B", 4096, 94, 64, 12288, 1536),
    _qwen_hybrid("qwen3-next-80b-a3b", "Qwen/Qwen3-Next-80B-A3B-Instruct", "qwen3_next", 2048, 48, 16, (512, 10, 512),
                 32, 151936),
    _qwen_hybrid("qwen3.5-397b-a17b", "Qwen/Qwen3.5-397B-A17B", "qwen3_5_moe", 4096, 60, 32, (512, 10, 1024), 64,
                 248320),
    _qwen_hybrid("qwen3.5-35b-a3b", "Qwen/Qwen3.5-35B-A3B", "qwen3_5_moe", 2048, 40, 16, (256, 8, 512), 32, 248320),
    _deepseek("deepseek-v3", "deepseek-ai/DeepSeek-V3", 128, 256, 3, 129280, 163840),
    _deepseek("deepseek-r1", "deepseek-ai/DeepSeek-R1", 128, 256, 3, 129280, 163840),
    _deepseek("kimi-k2", "moonshotai/Kimi-K2-Instruct", 64, 384, 1, 163840, 131072),
    _kimi_k25("kimi-k2.5", "moonshotai/Kimi-K2.5"),
    _minimax_m2("minimax-m2.5", "MiniMaxAI/MiniMax-M2.5"),
    _glm("glm-4.5", "zai-org/GLM-4.5", 5120, 92, 12288, 1536, 160, 3),
    _glm("glm-4.5-air", "zai-org/GLM-4.5-Air", 4096, 46, 10944, 1408, 128, 1),
    _deepseek_v32("deepseek-v3.2", "deepseek-ai/DeepSeek-V3.2"),
    _glm5("glm-5", "zai-org/GLM-5"),
    _gpt_oss("gpt-oss-20b", 24, 32),
    _gpt_oss("gpt-oss-120b", 36, 128),
    Entry("mixtral-8x7b", ModelSpec(
        model_type="mixtral", name="mixtral-8x7b", vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32,
        num_kv_heads=8, head_dim=128, intermediate_size=14336, max_position=32768, rope_theta=1e6, rms_norm_eps=1e-5,
        moe=MoESpec(num_experts=8, top_k=2, expert_intermediate_size=14336)), "mistralai/Mixtral-8x7B-v0.1"),
    _gemma3("gemma-3-270m", "google/gemma-3-270m", _Dims(640, 18, 4, 1, 2048), 256, 262144, 512, 256.0, 32768),
    _gemma3("gemma-3-27b", "google/gemma-3-27b-it", _Dims(5376, 62, 32, 16, 21504), 128, 262208, 1024, 168.0, 131072,
            vision=True),
    _gemma4("gemma-4-31b", "google/gemma-4-31B-it", 5376, 60, 32, 16, 4, 21504),
    _gemma4("gemma-4-26b-a4b", "google/gemma-4-26B-A4B-it", 2816, 30, 16, 8, 2, 2112, experts=(128, 8, 704)),
    _gemma3("gemma-3-4b", "google/gemma-3-4b-it", _Dims(2560, 34, 8, 4, 10240), 256, 262208, 1024, 256.0, 131072,
            vision=True),
    _gemma3("gemma-3-12b", "google/gemma-3-12b-it", _Dims(3840, 48, 16, 8, 15360), 256, 262208, 1024, 256.0, 131072,
            vision=True),
]

CATALOG: dict[str, Entry] = {e.name: e for e in ENTRIES}


def find(name: str) -> Entry:
    """Catalog entry by name (case and punctuation tolerant); a PlanError lists close matches."""
    key = normalize(name).replace("_", "-")
    for e in ENTRIES:
        if key in (normalize(e.name), *map(normalize, e.aliases)) or key == normalize(e.repo.split("/")[-1]):
            return e
    close = difflib.get_close_matches(key, list(CATALOG), n=4, cutoff=0.4)
    hint = f"; close matches: {', '.join(close)}" if close else ""
    raise PlanError(f"{name!r} is not a file, a model folder, or a catalog model{hint} "
                    f"(catalog: {', '.join(CATALOG)})")
