"""The planner's memory model against figures derived here, independently of its code."""

from __future__ import annotations

import pytest

from twinfer.planners.catalog import find
from twinfer.planners.formats import MIXES
from twinfer.planners.hardware import Cluster
from twinfer.planners.hw_table import DEVICES
from twinfer.planners.plan import make_plan
from twinfer.planners.search import Request


def _plan_kv_per_token(model: str, context: int, hardware: str = "h200", gpus: int = 1) -> float:
    plan = make_plan(find(model).profile(), Cluster(DEVICES[hardware], gpus), Request(context, 1, "auto", "bf16"))
    assert plan.fits
    return plan.to_json()["memory"]["kv_bytes_per_token"]


def test_kv_bytes_per_token_gqa_llama_3_1_8b() -> None:
    # 32 layers x 8 KV heads x 128 dims x (K and V) x 2 bytes
    assert _plan_kv_per_token("llama-3.1-8b", 4096) == 32 * 8 * 128 * 2 * 2 == 131072


def test_kv_bytes_per_token_mla_deepseek_v3() -> None:
    # one compressed latent (512) plus the decoupled rope key (64) per layer, 2 bytes, shared by all heads
    assert _plan_kv_per_token("deepseek-v3", 4096, gpus=8) == 61 * (512 + 64) * 2 == 70272


def test_kv_bytes_per_token_sliding_window_gemma_3_27b_at_32k() -> None:
    context, window, layers = 32768, 1024, 62
    global_layers = [i for i in range(layers) if i % 6 == 5]  # 5 local layers, then 1 global
    per_layer_token = 2 * 16 * 128 * 2  # K and V, 16 KV heads of 128, bf16
    cached = len(global_layers) * context + (layers - len(global_layers)) * window  # tokens held per sequence
    true = cached * per_layer_token / context
    assert len(global_layers) == 10
    assert find("gemma-3-27b").spec.kv_bytes_per_token(2, context) == pytest.approx(true, rel=1e-12)
    assert true == 95232.0  # a calculator treating every layer as global would say 507904 (+433%)
    # what a plan prices is what its runner allocates: the torch runner pages sliding layers at full length
    assert _plan_kv_per_token("gemma-3-27b", context) == layers * per_layer_token == 507904


def test_kv_bytes_per_token_alternating_window_gpt_oss_120b() -> None:
    context = 8192
    per_layer_token = 2 * 8 * 64 * 2
    cached = 18 * context + 18 * 128  # layers alternate: window 128, full
    assert find("gpt-oss-120b").spec.kv_bytes_per_token(2, context) == pytest.approx(cached * per_layer_token / context)
    # the torch runner pages sliding layers at full length, and the plan prices what it allocates
    assert _plan_kv_per_token("gpt-oss-120b", context) == 36 * per_layer_token


@pytest.mark.parametrize(
    "model,published",
    [
        ("llama-3.1-8b", 8.03e9), ("llama-3.1-70b", 70.6e9), ("llama-3.1-405b", 405.9e9),
        ("deepseek-v3", 671e9), ("gpt-oss-120b", 116.8e9), ("gpt-oss-20b", 20.9e9), ("mixtral-8x7b", 46.7e9),
        ("qwen3-30b-a3b", 30.5e9), ("qwen3-235b-a22b", 235e9), ("kimi-k2", 1.03e12), ("gemma-3-270m", 268e6),
    ],
)
def test_catalog_parameter_counts_match_published_totals(model: str, published: float) -> None:
    assert find(model).profile().total_params == pytest.approx(published, rel=0.01)


@pytest.mark.parametrize("model,active", [("deepseek-v3", 37e9), ("qwen3-30b-a3b", 3.3e9), ("gpt-oss-120b", 5.1e9),
                                          ("gpt-oss-20b", 3.6e9), ("mixtral-8x7b", 12.9e9), ("kimi-k2", 32e9)])
def test_catalog_active_parameters(model: str, active: float) -> None:
    # published active counts include the embedding row and router; ours count what a token multiplies
    assert find(model).profile().active_params == pytest.approx(active, rel=0.1)


def test_gguf_bytes_per_weight_of_llama_2_7b_match_the_published_files() -> None:
    # llama.cpp's Llama-2-7B files: Q4_0 3.56 GiB, Q8_0 6.67 GiB, F16 12.55 GiB
    profile = find("llama-2-7b").profile()
    for fmt, gib in (("q4_0", 3.56), ("q8_0", 6.67), ("f16", 12.55)):
        assert profile.weight_bytes(MIXES[fmt]) / 2**30 == pytest.approx(gib, abs=0.01)


def test_gpt_oss_gguf_mix_matches_ggml_org_files() -> None:
    # ggml-org/gpt-oss-20b-GGUF is 11.27 GiB, -120b 59.02 GiB (MXFP4 experts, Q8_0 elsewhere)
    assert find("gpt-oss-20b").profile().weight_bytes(MIXES["gguf-mxfp4"]) / 2**30 == pytest.approx(11.27, rel=0.01)
    assert find("gpt-oss-120b").profile().weight_bytes(MIXES["gguf-mxfp4"]) / 2**30 == pytest.approx(59.02, rel=0.01)


def test_default_gguf_weights_equal_the_files_tensor_bytes() -> None:
    gguf = pytest.importorskip("gguf")
    from twinfer.planners.source import resolve
    from twinfer.runtime.loaders import default_model_path

    reader = gguf.GGUFReader(str(default_model_path()))
    true = sum(int(t.n_bytes) for t in reader.tensors)
    profile = resolve(None)
    assert profile.stored is not None
    assert profile.weight_bytes(profile.stored) == true


def test_moe_batch_one_footprint_versus_serving() -> None:
    p = find("gpt-oss-20b").profile()
    assert p.touched_experts(1) == pytest.approx(4)  # top-4 of 32
    assert p.touched_experts(64) > 31  # a serving batch reaches every expert


def _tiny_qwen3_moe(folder) -> int:
    """A 2-layer Qwen3-MoE folder in float16; returns the tensor bytes written."""
    import json

    np = pytest.importorskip("numpy")
    st = pytest.importorskip("safetensors.numpy")
    V, C, H, KV, D, E, Ie = 64, 32, 4, 2, 8, 4, 16
    config = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": V,
              "hidden_size": C, "num_hidden_layers": 2, "num_attention_heads": H, "num_key_value_heads": KV,
              "head_dim": D, "intermediate_size": 64, "moe_intermediate_size": Ie, "num_experts": E,
              "num_experts_per_tok": 2, "norm_topk_prob": True, "max_position_embeddings": 256,
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
              "decoder_sparse_step": 1, "mlp_only_layers": [], "torch_dtype": "float16"}
    shapes = {"model.embed_tokens.weight": (V, C), "model.norm.weight": (C,), "lm_head.weight": (V, C)}
    for i in range(2):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (C,), p + "post_attention_layernorm.weight": (C,),
                       p + "self_attn.q_proj.weight": (H * D, C), p + "self_attn.k_proj.weight": (KV * D, C),
                       p + "self_attn.v_proj.weight": (KV * D, C), p + "self_attn.o_proj.weight": (C, H * D),
                       p + "self_attn.q_norm.weight": (D,), p + "self_attn.k_norm.weight": (D,),
                       p + "mlp.gate.weight": (E, C)})
        for e in range(E):
            shapes.update({f"{p}mlp.experts.{e}.gate_proj.weight": (Ie, C), f"{p}mlp.experts.{e}.up_proj.weight": (Ie, C),
                           f"{p}mlp.experts.{e}.down_proj.weight": (C, Ie)})
    tensors = {k: np.full(s, 0.01, dtype=np.float16) for k, s in shapes.items()}
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    st.save_file(tensors, str(folder / "model.safetensors"))
    return sum(t.nbytes for t in tensors.values())


def test_hf_folder_is_planned_from_its_stored_tensor_sizes(tmp_path) -> None:
    from twinfer.planners.source import resolve

    folder = tmp_path / "tiny-qwen3-moe"
    written = _tiny_qwen3_moe(folder)
    profile = resolve(str(folder))
    assert profile.stored is not None and profile.moe is not None
    assert profile.weight_bytes(profile.stored) == written
    assert profile.count("experts") == 2 * 4 * 2 * 16 * 32 and profile.count("experts_down") == 2 * 4 * 32 * 16
    plan = make_plan(profile, Cluster(DEVICES["rtx-4090"]), Request(128, 1)).to_json()
    assert plan["fits"] and plan["weights_format"] == "stored" and plan["memory"]["weights_bytes"] == written
