"""minimax_m2 (MiniMax-M2 / M2.5) and kimi_k25 (Kimi K2.5) on torch and MLX against transformers.

Tiny random-weight transformers models (norms near 1, router score biases non-zero) are saved as
fp32 safetensors and loaded by twinfer; logits must match transformers to 1e-4 on a prefill and 8
greedy decode steps through the paged KV cache, for two sequences (test_arch_logits.py's workload).
"""

from __future__ import annotations

import json
import subprocess
import sys
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
from test_arch_logits import BUILDERS, TOL, _char_tokenizer, max_error  # noqa: E402

from twinfer.runtime.errors import UnsupportedArchitecture  # noqa: E402
from twinfer.runtime.loaders import load_model  # noqa: E402

BASE = dict(vocab_size=128, hidden_size=64, max_position_embeddings=256, attn_implementation="eager")
MINIMAX: dict[str, dict[str, Any]] = {
    # heads / kv groups, experts and top-k, rotary_dim (partial or whole head)
    "minimax_m2-a": dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, rotary_dim=8),
    "minimax_m2-b": dict(num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=1, head_dim=8,
                         intermediate_size=24, num_local_experts=4, num_experts_per_tok=3, rotary_dim=4,
                         rope_theta=500.0),
    "minimax_m2-c": dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                         intermediate_size=32, num_local_experts=6, num_experts_per_tok=1, rotary_dim=16),
}  # fmt: skip
_ROOT = tempfile.TemporaryDirectory()


@cache
def minimax_model(case: str) -> Any:
    return random_causal_lm("MiniMaxM2", {**BASE, **{**MINIMAX, **GGUF_CASES}[case]})


@cache
def minimax_saved(case: str) -> Path:
    path = Path(_ROOT.name) / case
    minimax_model(case).save_pretrained(path)
    return path


# -- minimax_m2 ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("case", "backend"), [
    *((c, "torch") for c in MINIMAX), ("minimax_m2-a", "mlx"),
    *(pytest.param(c, "mlx", marks=pytest.mark.slow) for c in list(MINIMAX)[1:]),
])
def test_minimax_m2_logits_match_transformers(case: str, backend: str) -> None:
    err = max_error(case, backend, minimax_saved(case), reference=minimax_model(case))
    print(f"{case} {backend}: max |dlogit| = {err:.2e}")
    assert err <= TOL


def test_minimax_m2_spec() -> None:
    spec = load_model(minimax_saved("minimax_m2-b")).spec
    assert spec.model_type == "minimax_m2" and spec.rotary_dim == 4 and spec.num_kv_heads == 1
    assert spec.moe is not None and (spec.moe.scoring, spec.moe.score_bias, spec.moe.top_k) == ("sigmoid", True, 3)
    assert load_model(minimax_saved("minimax_m2-a")).weights.shape("layers.0.q_norm") == (4 * 16,)  # whole projection


def _released_config(folder: Path, **changes: Any) -> None:
    """config.json as MiniMax publishes it: transformers 4 keys (`rotary_dim`, `rope_theta`) and the
    fields transformers 5 drops (`scoring_func`, `use_qk_norm`, MTP modules...)."""
    config = json.loads((folder / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config |= dict(rope_theta=rope["rope_theta"], scoring_func="sigmoid", use_qk_norm=True, qk_norm_type="per_layer",
                   use_routing_bias=True, shared_intermediate_size=0, use_mtp=True, mtp_transformer_layers=1,
                   attn_type_list=[1] * config["num_hidden_layers"]) | changes
    (folder / "config.json").write_text(json.dumps(config))


def test_minimax_m2_released_config_and_mtp_skipped(tmp_path: Path) -> None:
    """`rotary_dim` without `partial_rotary_factor` sets the rotary share; MTP modules' layers are skipped."""
    from safetensors.numpy import load_file, save_file

    folder = tmp_path / "released"
    minimax_model("minimax_m2-a").save_pretrained(folder)
    _released_config(folder, num_mtp_modules=1)
    state = load_file(str(folder / "model.safetensors"))
    state["model.layers.2.self_attn.q_proj.weight"] = np.zeros((64, 64), np.float32)  # layer N: an MTP module
    save_file(state, str(folder / "model.safetensors"))
    loaded = load_model(folder)
    assert loaded.spec.rotary_dim == 8 and loaded.spec.num_layers == 2
    assert not any(name.startswith("layers.2.") for name in loaded.weights.names())
    assert max_error("", "torch", folder, reference=minimax_model("minimax_m2-a")) <= TOL


@pytest.mark.parametrize(("key", "value"), [("qk_norm_type", "per_head"), ("scoring_func", "softmax"),
                                            ("shared_intermediate_size", 256), ("attn_type_list", [0, 1])])
def test_minimax_m2_unimplemented_fields_are_refused_by_name(tmp_path: Path, key: str, value: Any) -> None:
    folder = tmp_path / "bad"
    minimax_model("minimax_m2-a").save_pretrained(folder)
    _released_config(folder, **{key: value})
    with pytest.raises(UnsupportedArchitecture) as info:
        load_model(folder)
    assert key in str(info.value) and "\n" not in str(info.value)


def _eval_kl(folder: Path, backend: str) -> dict[str, Any]:
    args = ["eval", "kl", str(folder), "--reference", "transformers", "--candidate", backend,
            "--tokens", "96", "--window", "48", "--json"]
    result = subprocess.run([sys.executable, "-c", "from twinfer.cli.main import main; main()", *args],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    report: dict[str, Any] = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("{")))
    print(f"{folder.name} {backend}: mean KL {report['mean_kl']:.2e}, top-1 {report['top1_agreement']:.3f}")
    return report


def test_minimax_m2_eval_kl_against_transformers(tmp_path: Path) -> None:
    folder = tmp_path / "minimax_m2-a"
    minimax_model("minimax_m2-a").save_pretrained(folder)
    _char_tokenizer(folder)
    report = _eval_kl(folder, "torch")
    assert report["tokens"] >= 90 and report["mean_kl"] <= 1e-5 and report["top1_agreement"] == 1.0


# -- kimi_k25 --------------------------------------------------------------------------------------
KIMI_TEXT = dict(intermediate_size=96, moe_intermediate_size=32, n_shared_experts=1, kv_lora_rank=16,
                 qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12)
KIMI: dict[str, dict[str, Any]] = {
    # q-LoRA or not, heads, experts and top-k, grouped routing, a dense first layer or none
    "kimi_k25-a": dict(KIMI_TEXT, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24,
                       n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
                       routed_scaling_factor=2.827, norm_topk_prob=True),
    "kimi_k25-b": dict(KIMI_TEXT, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=None,
                       n_routed_experts=4, num_experts_per_tok=1, n_group=1, topk_group=1, first_k_dense_replace=0,
                       rope_interleave=False),
}  # fmt: skip
# GGUF cases: the tiny tokenizer of tests/gguf_convert.py has 320 tokens
GGUF_CASES: dict[str, dict[str, Any]] = {
    "minimax_m2-gguf": dict(MINIMAX["minimax_m2-a"], vocab_size=320, max_position_embeddings=512),
    "kimi_k25-gguf": dict(KIMI["kimi_k25-a"], vocab_size=320, max_position_embeddings=512),
}
# The smallest vision tower transformers builds: one layer (skipped by name, never run here)
KIMI_VISION = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=32, num_attention_heads=2, patch_size=14,
                   pos_emb_height=4, pos_emb_width=4, pos_emb_time=1)


@cache
def kimi_model(case: str) -> Any:
    """transformers' Kimi K2.5 whose text model holds a random DeepSeek-V3's weights (fixtures_models' init)."""
    text_kwargs = {**BASE, **{**KIMI, **GGUF_CASES}[case]}
    text = random_causal_lm("DeepseekV3", text_kwargs)
    del text_kwargs["attn_implementation"]
    config = transformers.Kimi_K25Config(text_config=dict(text_kwargs, model_type="kimi_k2"), vision_config=KIMI_VISION,
                                         projection_hidden_size=32, tie_word_embeddings=False)
    config._attn_implementation = "eager"
    model = transformers.Kimi_K25ForConditionalGeneration(config).eval()
    model.model.language_model.load_state_dict(text.model.state_dict())
    model.lm_head.load_state_dict(text.lm_head.state_dict())
    return model


def save_kimi_published(model: Any, folder: Path) -> dict[str, np.ndarray]:
    """The checkpoint as Moonshot publishes it: the text model under `language_model.model.layers`, one
    linear per expert, the vision tower and `mm_projector` beside it. The text part is written here from
    the model's weights (transformers' own save renames some text layers by its vision rules); the vision
    part is transformers' save, with the projector's norm moved out of `model.`. Returns the tensors."""
    from safetensors.numpy import load_file, save_file

    model.save_pretrained(folder)
    saved = load_file(str(folder / "model.safetensors"))
    state = {k.removeprefix("model."): v for k, v in saved.items() if k.startswith(("vision_tower.", "mm_projector.",
                                                                                     "model.mm_projector."))}
    for key, value in model.state_dict().items():
        w = value.detach().float().numpy()
        if key == "lm_head.weight":
            state["language_model.lm_head.weight"] = w
        elif key.startswith("model.language_model."):
            name = "language_model.model." + key.removeprefix("model.language_model.")
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                module, fused = name.rsplit(".", 1)
                half = w.shape[1] // 2
                for e in range(w.shape[0]):
                    parts = {"down_proj": w[e]} if fused == "down_proj" else {"gate_proj": w[e, :half],
                                                                              "up_proj": w[e, half:]}
                    state |= {f"{module}.{e}.{proj}.weight": np.ascontiguousarray(x) for proj, x in parts.items()}
            else:
                state[name] = w
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return state


@cache
def kimi_saved(case: str) -> Path:
    path = Path(_ROOT.name) / case
    save_kimi_published(kimi_model(case), path)
    return path


def test_kimi_k25_published_layout_is_what_transformers_reads() -> None:
    """transformers loads the hand-written published folder with every weight in place: the layout is real."""
    model, info = transformers.Kimi_K25ForConditionalGeneration.from_pretrained(
        kimi_saved("kimi_k25-a"), output_loading_info=True, attn_implementation="eager")
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    tokens = torch.tensor([[3, 17, 99, 5, 64]])
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, kimi_model("kimi_k25-a")(tokens).logits)


@pytest.mark.parametrize("backend", sorted(BUILDERS))
@pytest.mark.parametrize("case", list(KIMI))
def test_kimi_k25_text_logits_match_transformers(case: str, backend: str) -> None:
    err = max_error(case, backend, kimi_saved(case), reference=kimi_model(case))
    print(f"{case} {backend}: max |dlogit| = {err:.2e}")
    assert err <= TOL


def test_kimi_k25_spec_and_skipped_vision() -> None:
    loaded = load_model(kimi_saved("kimi_k25-a"))
    spec = loaded.spec
    assert spec.model_type == "deepseek_v3" and not spec.tie_word_embeddings
    assert spec.mla is not None and (spec.mla.q_lora_rank, spec.moe.n_group if spec.moe else 0) == (24, 2)
    assert not any("vision" in n or "projector" in n for n in loaded.weights.names())


# -- kimi_k25 as published: INT4 compressed-tensors experts ------------------------------------------
KIMI_IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"]


def int4_writer() -> tuple[Any, dict[str, Any]]:
    """compressed-tensors' own pack-quantized compressor for Kimi K2.5's scheme (symmetric int4, groups of
    32, bf16 scales) and the config it writes: w -> ({suffix: tensor}, dequantized w)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    comp = BaseCompressor.get_value_from_registry("pack-quantized")

    def write(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        g = w.float().unflatten(-1, (w.shape[1] // 32, 32))
        scale, _ = calculate_qparams(g.amin(-1), g.amax(-1), args)
        scale = scale.to(torch.bfloat16)  # as published
        parts = dict(comp.compress({"weight": w.float(), "weight_scale": scale.float()}, scheme))
        parts["weight_scale"] = scale
        deq = comp.decompress({**parts, "weight_scale": scale.float()}, scheme)["weight"].float()
        return parts, deq

    config = QuantizationConfig(config_groups={"group_0": scheme}, format="pack-quantized",
                                quantization_status="compressed", ignore=KIMI_IGNORE).model_dump(mode="json")
    return write, config


@cache
def kimi_int4(case: str) -> tuple[Path, Any]:
    """`case` saved as published with INT4 routed experts, and transformers on the dequantized experts."""
    import copy

    from safetensors.torch import save_file

    model = copy.deepcopy(kimi_model(case))
    folder = Path(_ROOT.name) / f"{case}-int4"
    state = {k: torch.from_numpy(v) for k, v in save_kimi_published(model, folder).items()}
    write, quant = int4_writer()
    for name in [n for n in state if ".mlp.experts." in n]:
        parts, deq = write(state.pop(name))
        state |= {name.removesuffix("weight") + k: v.contiguous() for k, v in parts.items()}
        layer, expert, proj = int(name.split(".")[3]), int(name.split(".")[6]), name.split(".")[7]
        experts = model.model.language_model.layers[layer].mlp.experts
        with torch.no_grad():  # transformers holds gate_up [E, 2I, C] (gate rows first) and down [E, C, I]
            if proj == "down_proj":
                experts.down_proj[expert].copy_(deq)
            else:
                half = experts.gate_up_proj.shape[1] // 2
                experts.gate_up_proj[expert, (0 if proj == "gate_proj" else half):][:half].copy_(deq)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["quantization_config"] = quant  # where Kimi K2.5 keeps it
    (folder / "config.json").write_text(json.dumps(config))
    return folder, model


def runner_error(runner: Any, reference: Any) -> float:
    """test_arch_logits' two-sequence workload on a built runner, against `reference`."""
    from test_arch_logits import PROMPT_A, PROMPT_B, generate

    worst = 0.0
    for seq, (prompt, first) in enumerate(((PROMPT_A, 0), (PROMPT_B, 30))):
        rows, new = generate(runner, seq, prompt, [first + 3 * i for i in range(8)])
        with torch.no_grad():
            ref = reference(torch.tensor([prompt + new])).logits[0].float().numpy()[: len(rows)]
        worst = max(worst, float(np.abs(rows - ref).max()))
    return worst


@pytest.mark.parametrize("backend", sorted(BUILDERS))
def test_kimi_k25_int4_experts_as_published(backend: str) -> None:
    """The routed experts stay INT4 in the weight set (MLX's affine layout, bias -8 * scale, the file's
    bytes), the rest float; both backends match transformers on the dequantized experts."""
    from test_arch_logits import BLOCK

    from twinfer.quant.linear import QuantizedExperts

    folder, reference = kimi_int4("kimi_k25-a")
    loaded = load_model(folder)
    kept = {n: f for n in loaded.weights.names() if (f := loaded.weights.format_of(n)) is not None}  # type: ignore[attr-defined]
    assert set(kept) == {f"layers.1.experts.{p}" for p in ("gate", "up", "down")} and set(kept.values()) == {"int4"}
    gate = loaded.weights["layers.1.experts.gate"]
    assert isinstance(gate, QuantizedExperts) and gate.fmt == "int4" and gate.shape == (8, 32, 64)
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        stored = f.get_tensor("language_model.model.layers.1.mlp.experts.0.gate_proj.weight_packed").numpy()
    first = gate.experts[0].packed
    assert np.array_equal(first.wq.view(np.int32), stored)
    assert np.array_equal(first.biases, -8 * first.scales) and first.group_size == 32
    weights = {n: loaded.weights[n] for n in loaded.weights.names()}  # what a runner holds
    err = runner_error(BUILDERS[backend](loaded.spec, weights, kv_tokens=64 * BLOCK, block_size=BLOCK), reference)
    print(f"kimi_k25-a int4 {backend}: max |dlogit| = {err:.2e}")
    assert err <= TOL


@pytest.mark.parametrize(("key", "value"), [("symmetric", False), ("num_bits", 2), ("group_size", 16)])
def test_kimi_k25_int_options_twinfer_cannot_hold_are_refused_by_name(tmp_path: Path, key: str, value: Any) -> None:
    from twinfer.runtime.loaders.published import QuantConfigError

    folder = tmp_path / "bad"
    folder.mkdir()
    config = json.loads((kimi_int4("kimi_k25-a")[0] / "config.json").read_text())
    config["text_config"]["quantization_config"]["config_groups"]["group_0"]["weights"][key] = value
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(QuantConfigError) as info:
        load_model(folder)
    assert f"weights.{key}" in str(info.value) or "weights=" in str(info.value), str(info.value)


# -- GGUF: llama.cpp's own converter, twinfer's graph against the llama.cpp runner --------------------
@cache
def gguf_files() -> dict[str, Path]:
    """minimax_m2 and Kimi K2.5 (published layout, INT4 experts) converted to f32 GGUF in one converter run.
    config.json carries the routing keys published configs have and transformers drops (`scoring_func`),
    and Kimi's published architecture name (transformers writes `Kimi_K25...`)."""
    pytest.importorskip("llama_cpp")
    from gguf_convert import convert_many, save_tiny_tokenizer

    root = Path(_ROOT.name)
    minimax = root / "minimax_m2-gguf"
    minimax_model("minimax_m2-gguf").save_pretrained(minimax)
    _released_config(minimax)
    kimi, _ = kimi_int4("kimi_k25-gguf")
    config = json.loads((kimi / "config.json").read_text())
    config["architectures"] = ["KimiK25ForConditionalGeneration"]
    config["text_config"] |= dict(scoring_func="sigmoid", topk_method="noaux_tc")
    (kimi / "config.json").write_text(json.dumps(config))
    for folder in (minimax, kimi):
        save_tiny_tokenizer(folder, "deepseek")
    out = {"minimax_m2": root / "minimax_m2.gguf", "kimi_k25": root / "kimi_k25.gguf"}
    convert_many([(minimax, out["minimax_m2"]), (kimi, out["kimi_k25"])], "f32")
    return out


@pytest.mark.parametrize("case", ["minimax_m2", "kimi_k25"])
def test_gguf_own_graph_matches_llamacpp(case: str) -> None:
    from test_arch_gguf import MAX_KL, MIN_TOP1, TOKENS, WINDOW

    from twinfer.app.models import open_model
    from twinfer.quant.fidelity import RunnerSource, corpus_windows
    from twinfer.quant.kl import KLAccumulator

    path = gguf_files()[case]
    spec = load_model(path).spec
    assert spec.model_type == {"minimax_m2": "minimax_m2", "kimi_k25": "deepseek_v3"}[case]
    windows = list(corpus_windows(str(path), "prose", TOKENS, WINDOW))
    llama = RunnerSource(open_model(str(path), "llamacpp", max_seqs=1, ctx=256).runner)
    ours = RunnerSource(open_model(str(path), "torch", max_seqs=1, ctx=256).runner)
    acc = KLAccumulator()
    for window in windows:
        ref = llama.logits(window)[:-1]
        assert float(ref.std()) > 0.5  # logits that can disagree
        acc.add(ref, ours.logits(window)[:-1])
    report = acc.report("llamacpp", "torch", "prose")
    print(f"{case} GGUF: mean KL {report.mean_kl:.2e}, max {report.max_kl:.2e}, top-1 {report.top1_agreement:.3f}")
    assert report.tokens >= TOKENS - len(windows)
    assert report.mean_kl <= MAX_KL and report.top1_agreement >= MIN_TOP1, report


def test_gguf_specs() -> None:
    mm = load_model(gguf_files()["minimax_m2"]).spec
    assert mm.rotary_dim == 8 and mm.num_kv_heads == 2 and mm.qk_norm
    assert mm.moe is not None and (mm.moe.scoring, mm.moe.score_bias, mm.moe.norm_topk_prob) == ("sigmoid", True, True)
    kimi = load_model(gguf_files()["kimi_k25"])
    assert kimi.spec.mla is not None and kimi.spec.mla.q_lora_rank == 24 and kimi.spec.moe is not None
    assert kimi.spec.moe.routed_scaling_factor == pytest.approx(2.827, rel=1e-6)
    # the converter dequantized the INT4 experts: the file holds the published values exactly
    expected = kimi_int4("kimi_k25-gguf")[1].model.language_model.layers[1].mlp.experts.down_proj.detach().numpy()
    np.testing.assert_array_equal(kimi.weights.load("layers.1.experts.down"), expected)


# -- expert streaming and parallelism --------------------------------------------------------------
@pytest.mark.parametrize(("case", "backend"), [
    ("minimax_m2-a", "torch"), ("kimi_k25-a", "torch"), ("kimi_k25-a-int4", "torch"),
    *(pytest.param(c, "mlx", marks=pytest.mark.slow) for c in ("minimax_m2-a", "kimi_k25-a")),
])
def test_streamed_greedy_equals_resident_at_half_budget(case: str, backend: str) -> None:
    """Batch-1 expert streaming through a cache of half the experts' float32 bytes gives the resident run's
    tokens (Kimi's published INT4 experts read from the file as stored)."""
    from test_arch_streaming import PROMPT, STEPS, _runners

    from twinfer.runtime.experts import expert_params
    from twinfer.runtime.synthetic import greedy_tokens

    stream, full = _runners(backend)
    folder = kimi_int4(case.removesuffix("-int4"))[0] if case.endswith("-int4") else (
        minimax_saved(case) if case.startswith("minimax") else kimi_saved(case))
    loaded = load_model(folder)
    spec = loaded.spec
    assert spec.moe is not None
    want = greedy_tokens(full(loaded, kv_tokens=64), PROMPT, STEPS)  # type: ignore[operator]
    moe_layers = sum(spec.is_moe_layer(i) for i in range(spec.num_layers))
    half = spec.moe.num_experts * moe_layers * expert_params(spec) * 4 // 2
    runner = stream(loaded, cache_bytes=half, kv_tokens=64)  # type: ignore[operator]
    cache = runner.ops.cache
    try:
        assert greedy_tokens(runner, PROMPT, STEPS) == want
        assert cache.stats.misses > 0 and cache.stats.evictions > 0 and cache.resident_bytes <= half
    finally:
        cache.close()


@pytest.mark.parametrize(("case", "config"), [
    ("minimax_m2-a", "tp2"), ("minimax_m2-b", "tp2"),
    *(pytest.param(c, p, marks=pytest.mark.slow) for c in ("minimax_m2-a", "minimax_m2-b") for p in ("ep2", "tp2xep2")),
])
def test_minimax_m2_parallel_matches_single_process(case: str, config: str) -> None:
    """TP splits the whole-projection QK norms with their heads (one KV head replicated in -b) and sums
    their mean square across the tensor group; logits within 1e-5 of one process, identical tokens."""
    from test_parallel import BLOCK, KV_TOKENS, workload
    from test_parallel import TOL as PARALLEL_TOL

    from twinfer.backends.cuda.parallel import ParallelConfig, RunOptions, WeightSource, launch
    from twinfer.backends.cuda.runner import load_torch_runner

    folder = minimax_saved(case)
    parallel = {"tp2": ParallelConfig(tp=2), "ep2": ParallelConfig(ep=2), "tp2xep2": ParallelConfig(tp=2, ep=2)}
    want_rows, want_tokens = workload(load_torch_runner(load_model(folder), kv_tokens=KV_TOKENS, block_size=BLOCK))
    runner = launch(WeightSource(path=str(folder)), parallel[config],
                    RunOptions(kv_tokens=KV_TOKENS, block_size=BLOCK, timeout_s=180))
    try:
        got_rows, got_tokens = workload(runner)
    finally:
        runner.close()
    err = float(np.abs(got_rows - want_rows).max())
    print(f"{case} {config}: max |dlogit| vs one process = {err:.2e}")
    assert got_rows.shape == want_rows.shape and err <= PARALLEL_TOL and got_tokens == want_tokens


def test_an_undecoded_image_part_is_refused_saying_how_images_arrive() -> None:
    """An image part the server did not decode gets a clear message, not a template error."""
    from twinfer.runtime.errors import RequestError
    from twinfer.runtime.tokenizer.chat import validate_messages

    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    with pytest.raises(RequestError, match=r"messages\[0\]\.content\[1\] has type 'image_url': audio and video are not supported, and images"):
        validate_messages([{"role": "user", "content": [{"type": "text", "text": "what is this?"}, image]}])
    assert validate_messages([{"role": "user", "content": [{"type": "text", "text": "hi"}]}])[0]["content"] == "hi"
