"""deepseek_v3, gpt_oss and glm4_moe from GGUF files that llama.cpp's own converter wrote.

Tiny random-weight transformers models (O(1) logits: norms, biases, sinks and router biases all
matter) are saved with a tiny tokenizer and chat template of their family and converted to f32 GGUF
by `convert_hf_to_gguf.py` of the installed llama-cpp-python (tests/gguf_convert.py). On each file:
twinfer's own graph (torch) against the llama.cpp runner, teacher-forced over a prose corpus (mean KL
<= 0.01, as for the default model), and greedy chat text through `twinfer generate` on the
llama.cpp runner with the file's template, equal to the torch graph's.
"""

from __future__ import annotations

import json
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("llama_cpp")

from fixtures_models import random_causal_lm  # noqa: E402
from gguf_convert import FAMILIES, convert_many, save_tiny_tokenizer  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from twinfer.app.models import open_model  # noqa: E402
from twinfer.cli.main import app  # noqa: E402
from twinfer.quant.fidelity import RunnerSource, corpus_windows  # noqa: E402
from twinfer.quant.kl import KLAccumulator  # noqa: E402
from twinfer.runtime.loaders import load_model  # noqa: E402
from twinfer.runtime.tokenizer import load_tokenizer  # noqa: E402

TOKENS, WINDOW = 192, 64
MAX_KL, MIN_TOP1 = 0.01, 0.94
BASE = dict(vocab_size=320, hidden_size=64, max_position_embeddings=512)
EXPERTS = dict(intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
               num_experts_per_tok=2)
CASES: dict[str, tuple[str, str, dict[str, Any], dict[str, Any]]] = {
    # case: (transformers prefix, tokenizer family, config, config.json keys a published checkpoint has)
    "deepseek_v3": ("DeepseekV3", "deepseek", dict(
        EXPERTS, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
        q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, n_group=4, topk_group=2,
        first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
        dict(scoring_func="sigmoid", topk_method="noaux_tc")),
    "glm4_moe": ("Glm4Moe", "glm", dict(
        EXPERTS, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        use_qk_norm=True, attention_bias=True, n_group=2, topk_group=1, first_k_dense_replace=1,
        routed_scaling_factor=2.5, norm_topk_prob=True,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5)),
        dict(num_nextn_predict_layers=0)),
    "gpt_oss": ("GptOss", "gpt_oss", dict(
        intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, head_dim=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=8,
        rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0,
                             original_max_position_embeddings=128, beta_fast=32.0, beta_slow=1.0)),
        {}),
}  # fmt: skip
# Bigger shapes and other layouts (slow): YaRN with DeepSeek's mscale, MXFP4 experts, an f16 file. (This
# llama.cpp reads DeepSeek files without q-LoRA only at the 26/27 layers of DeepSeek-V2-Lite.)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=128,
            beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)
SLOW: dict[str, tuple[str, dict[str, Any], str]] = {
    # case: (base case, config changes, outtype)
    "deepseek_v3-yarn": ("deepseek_v3", dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=8,
                                             num_key_value_heads=8, q_lora_rank=32, kv_lora_rank=32,
                                             n_group=1, topk_group=1, rope_parameters=YARN), "f32"),
    "gpt_oss-mxfp4": ("gpt_oss", dict(hidden_size=128, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=8), "f32"),
    "glm4_moe-f16": ("glm4_moe", dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=8,
                                      num_key_value_heads=2, head_dim=32), "f16"),
}  # fmt: skip
_ROOT = tempfile.TemporaryDirectory()


def _config(case: str) -> tuple[str, str, dict[str, Any], dict[str, Any]]:
    if case in CASES:
        return CASES[case]
    base, changes, _ = SLOW[case]
    prefix, family, kwargs, published = CASES[base]
    return prefix, family, kwargs | changes, published


def _hf_model(case: str) -> Any:
    prefix, _, kwargs, _ = _config(case)
    return random_causal_lm(prefix, {**BASE, **kwargs})


def _save_mxfp4(model: Any, folder: Path) -> None:
    """gpt-oss as published: experts as MXFP4 `*_blocks` / `*_scales` (quant/mxfp4.py), the rest float."""
    from safetensors.numpy import save_file

    from twinfer.formats import mxfp4

    state = {k: v.detach().float().numpy().copy() for k, v in model.state_dict().items()}
    for key in [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        packed = [mxfp4.pack(np.ascontiguousarray(w.T)) for w in state.pop(key)]  # [E, in, out] -> [out, in]
        state[key + "_blocks"] = np.ascontiguousarray(np.stack([p.blocks for p in packed]))
        state[key + "_scales"] = np.ascontiguousarray(np.stack([p.scales for p in packed]))
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads(model.config.to_json_string()) | {"architectures": [type(model).__name__]}
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (folder / "config.json").write_text(json.dumps(config))


def _mxfp4_experts(case: str, name: str, layer: int = 0) -> np.ndarray:
    """The MXFP4-rounded experts of `case` as [E, out, in], from transformers' [E, in, out]."""
    from twinfer.formats import mxfp4

    w = _hf_model(case).state_dict()[f"model.layers.{layer}.mlp.experts.{name}"].float().numpy()
    return np.stack([mxfp4.pack(np.ascontiguousarray(x.T)).unpack() for x in w])


@cache
def gguf_files(cases: tuple[str, ...] = tuple(CASES)) -> dict[str, Path]:
    """`cases` saved as Hugging Face folders and converted (in one converter process per outtype) to GGUF."""
    root = Path(_ROOT.name)
    jobs: dict[str, list[tuple[Path, Path]]] = {}
    for case in cases:
        _, family, _, published = _config(case)
        folder = root / case
        if case.endswith("-mxfp4"):
            _save_mxfp4(_hf_model(case), folder)
        else:
            _hf_model(case).save_pretrained(folder)
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps(config | published, indent=1))
        save_tiny_tokenizer(folder, family)
        outtype = SLOW[case][2] if case in SLOW else "f32"
        jobs.setdefault(outtype, []).append((folder, root / f"{case}.gguf"))
    for outtype, pairs in jobs.items():
        convert_many(pairs, outtype)
    return {case: root / f"{case}.gguf" for case in cases}


@pytest.mark.parametrize("case", [*CASES, *(pytest.param(c, marks=pytest.mark.slow) for c in SLOW)])
def test_own_graph_matches_llamacpp(case: str) -> None:
    path = (gguf_files() if case in CASES else gguf_files(tuple(SLOW)))[case]
    loaded = load_model(path)
    assert loaded.spec.model_type == case.split("-")[0]
    min_top1 = MIN_TOP1
    if case.endswith("-mxfp4"):  # llama.cpp's converter kept the published blocks, which twinfer reads exactly
        assert loaded.weights.dtype_stored("layers.0.experts.gate") == "MXFP4"
        assert np.array_equal(loaded.weights.load("layers.0.experts.down"), _mxfp4_experts(case, "down_proj"))
        min_top1 = 0.9  # llama.cpp rounds activations to 8 bits for MXFP4 matmuls: measured 0.937, KL 4.7e-3
    windows = list(corpus_windows(str(path), "prose", TOKENS, WINDOW))
    llama = RunnerSource(open_model(str(path), "llamacpp", max_seqs=1, ctx=256).runner)
    ours = RunnerSource(open_model(str(path), "torch", max_seqs=1, ctx=256).runner)
    acc = KLAccumulator()
    for window in windows:
        ref = llama.logits(window)[:-1]
        assert float(ref.std()) > 0.5  # logits that can disagree
        acc.add(ref, ours.logits(window)[:-1])
    report = acc.report("llamacpp", "torch", "prose")
    print(f"{case}: mean KL {report.mean_kl:.2e}, max {report.max_kl:.2e}, top-1 {report.top1_agreement:.3f}")
    assert report.tokens >= TOKENS - len(windows)
    assert report.mean_kl <= MAX_KL and report.top1_agreement >= min_top1, report


def test_specs_from_gguf_metadata() -> None:
    ds = load_model(gguf_files()["deepseek_v3"]).spec
    assert ds.mla is not None and (ds.mla.kv_lora_rank, ds.mla.q_lora_rank, ds.mla.v_head_dim) == (16, 24, 12)
    assert (ds.num_kv_heads, ds.head_dim, ds.rotary_dim) == (4, 24, 8)  # the file's MQA view undone
    assert ds.moe is not None and (ds.moe.scoring, ds.moe.n_group, ds.moe.topk_group) == ("sigmoid", 4, 2)
    assert (ds.moe.first_dense_layers, ds.moe.num_shared_experts, ds.moe.routed_scaling_factor) == (1, 1, 2.5)
    glm = load_model(gguf_files()["glm4_moe"]).spec
    assert glm.qk_norm and glm.attention_bias and glm.rotary_dim == 8 and glm.num_layers == 3
    oss = load_model(gguf_files()["gpt_oss"]).spec
    assert oss.attention_sinks and oss.window(0) == 8 and oss.window(1) is None
    assert oss.moe is not None and (oss.moe.swiglu_limit, oss.moe.router_bias, oss.moe.expert_bias) == (7.0, True, True)


@pytest.mark.parametrize("case", list(CASES))
def test_generate_uses_the_files_chat_template(case: str) -> None:
    path = gguf_files()[case]
    specials, _, template = FAMILIES[CASES[case][1]]
    tokenizer = load_tokenizer(path)
    assert tokenizer.chat_template == template  # read from the file, not a built-in one
    prompt = tokenizer.encode_chat([{"role": "user", "content": "The engine"}])
    marker = {"deepseek_v3": "<｜User｜>", "glm4_moe": "<|user|>", "gpt_oss": "<|start|>"}[case]
    assert tokenizer.encode(marker, add_special_tokens=False)[0] in prompt and marker in specials
    texts = {}
    for backend in ("llamacpp", "torch"):
        r = CliRunner().invoke(app, ["generate", str(path), "The engine", "--backend", backend, "--chat",
                                     "-n", "12", "-t", "0", "--threads", "1"])
        assert r.exit_code == 0, r.output
        texts[backend] = r.stdout
    assert texts["llamacpp"].strip() and texts["llamacpp"] == texts["torch"], texts


def test_a_softmax_routed_deepseek2_file_is_refused_by_name(tmp_path: Path) -> None:
    """DeepSeek-V2 files carry no gating key and route by softmax, which twinfer's deepseek_v3 does not run."""
    from twinfer.quant.gguf_rewrite import SKIP, rewrite_gguf
    from twinfer.runtime.errors import UnsupportedArchitecture

    legacy = rewrite_gguf(gguf_files()["deepseek_v3"], tmp_path / "v2.gguf",
                          values=lambda key, v: SKIP if key == "deepseek2.expert_gating_func" else v)
    with pytest.raises(UnsupportedArchitecture, match=r"deepseek2\.expert_gating_func is absent \(softmax\)"):
        load_model(legacy)
