"""glm4_moe, deepseek_v3 (and kimi_k2) and gpt_oss on torch and MLX against transformers.

Each architecture is built from several tiny transformers configs (no download) with random
weights, saved as fp32 safetensors and loaded by twinfer. Both backends must match transformers to
1e-4 on a prefill and 8 greedy decode steps through the paged KV cache, for two sequences.
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
from fixtures_models import random_causal_lm

from twinfer.runtime.batch import LogitsWanted, SeqChunk, StepBatch
from twinfer.runtime.errors import UnsupportedArchitecture
from twinfer.runtime.loaders import load_model
from twinfer.runtime.loaders.published import QuantConfigError
from twinfer.runtime.runner import OpsRunner

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
mx = pytest.importorskip("mlx.core")

from twinfer.backends.cuda.runner import build_torch_runner  # noqa: E402
from twinfer.backends.metal.runner import build_mlx_runner  # noqa: E402

TOL = 1e-4
DECODE_STEPS = 8
BLOCK = 4
PROMPT_A = [3, 17, 99, 5, 64, 120, 8, 41, 77, 2, 56]
PROMPT_B = [9, 33, 101, 7, 60]
BASE = dict(vocab_size=128, hidden_size=64, max_position_embeddings=256, attn_implementation="eager")

GLM = dict(intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
           num_experts_per_tok=2, head_dim=16)
DEEPSEEK = dict(intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
                num_experts_per_tok=2, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12)
GPT_OSS = dict(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, head_dim=16)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64,
            beta_fast=32.0, beta_slow=1.0)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    # glm4_moe: partial rotary, qk-norm on/off, biases on/off, grouped routing, a dense first layer
    "glm4_moe-a": ("Glm4Moe", dict(GLM, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                   use_qk_norm=True, attention_bias=True, n_group=2, topk_group=1,
                                   first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                                   rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                        partial_rotary_factor=0.5))),
    "glm4_moe-b": ("Glm4Moe", dict(GLM, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=1,
                                   use_qk_norm=False, attention_bias=False, n_group=1, topk_group=1,
                                   first_k_dense_replace=0, routed_scaling_factor=1.0, norm_topk_prob=False,
                                   rope_parameters=dict(rope_type="default", rope_theta=500.0,
                                                        partial_rotary_factor=0.75))),
    # deepseek_v3: q-LoRA or not, YaRN with mscale, interleaved rope or not, groups
    "deepseek_v3-a": ("DeepseekV3", dict(DEEPSEEK, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24,
                                         n_group=4, topk_group=2, first_k_dense_replace=1,
                                         routed_scaling_factor=2.5, norm_topk_prob=True,
                                         rope_parameters=dict(YARN, mscale=1.0, mscale_all_dim=1.0))),
    "deepseek_v3-b": ("DeepseekV3", dict(DEEPSEEK, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=None,
                                         n_group=1, topk_group=1, first_k_dense_replace=0, rope_interleave=False,
                                         norm_topk_prob=False, attention_bias=True,
                                         rope_parameters=dict(rope_type="default", rope_theta=10000.0))),
    "deepseek_v3-c": ("DeepseekV3", dict(DEEPSEEK, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8, q_lora_rank=12,
                                         n_group=2, topk_group=2, first_k_dense_replace=1,
                                         rope_parameters=dict(YARN, factor=8.0, original_max_position_embeddings=32, mscale=0.707, mscale_all_dim=0.707))),
    # gpt_oss: sinks, sliding windows of 4 and 6 (shorter than the prompt), YaRN or plain rope, clamps
    "gpt_oss-a": ("GptOss", dict(GPT_OSS, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                 sliding_window=4, rope_parameters=dict(YARN, truncate=False))),
    "gpt_oss-b": ("GptOss", dict(GPT_OSS, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
                                 sliding_window=6, swiglu_limit=0.5,
                                 layer_types=["full_attention", "sliding_attention", "sliding_attention"],
                                 rope_parameters=dict(rope_type="default", rope_theta=10000.0))),
}  # fmt: skip
BUILDERS = {"torch": build_torch_runner, "mlx": build_mlx_runner}
_ROOT = tempfile.TemporaryDirectory()


@cache
def hf_model(case: str) -> Any:
    prefix, kwargs = CASES[case]
    return random_causal_lm(prefix, {**BASE, **kwargs})


@cache
def saved(case: str) -> Path:
    path = Path(_ROOT.name) / case
    hf_model(case).save_pretrained(path)
    return path


@cache
def hf_logits(case: str, tokens: tuple[int, ...]) -> np.ndarray:
    with torch.no_grad():
        return hf_model(case)(torch.tensor([tokens])).logits[0].float().numpy()


def generate(runner: OpsRunner, seq: int, prompt: list[int], table: list[int]) -> tuple[np.ndarray, list[int]]:
    rows = [runner.step(StepBatch([SeqChunk(seq, prompt, 0, table, LogitsWanted.ALL)]))]
    new: list[int] = []
    for _ in range(DECODE_STEPS):
        new.append(int(rows[-1][-1].argmax()))
        rows.append(runner.step(StepBatch([SeqChunk(seq, [new[-1]], len(prompt) + len(new) - 1, table)])))
    return np.concatenate(rows), new


def max_error(case: str, backend: str, folder: Path | None = None, reference: Any = None) -> float:
    """max |twinfer - transformers| over two sequences' prefill and decode rows (`reference`: another
    transformers model than the case's)."""
    loaded = load_model(folder or saved(case))
    weights = {name: loaded.weights.load(name) for name in loaded.weights.names()}
    runner = BUILDERS[backend](loaded.spec, weights, kv_tokens=64 * BLOCK, block_size=BLOCK)
    worst = 0.0
    for seq, (prompt, first) in enumerate(((PROMPT_A, 0), (PROMPT_B, 30))):
        rows, new = generate(runner, seq, prompt, [first + 3 * i for i in range(8)])
        if reference is None:
            ref = hf_logits(case, tuple(prompt + new))[: len(rows)]
        else:
            with torch.no_grad():
                ref = reference(torch.tensor([prompt + new])).logits[0].float().numpy()[: len(rows)]
        worst = max(worst, float(np.abs(rows - ref).max()))
    return worst


@pytest.mark.parametrize("backend", sorted(BUILDERS))
@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case: str, backend: str) -> None:
    err = max_error(case, backend)
    print(f"{case} {backend}: max |dlogit| = {err:.2e}")
    assert err <= TOL


def test_specs_from_configs() -> None:
    glm = load_model(saved("glm4_moe-a")).spec
    assert glm.model_type == "glm4_moe" and glm.qk_norm and glm.rotary_dim == 8 and glm.attention_bias
    assert glm.moe is not None and (glm.moe.scoring, glm.moe.n_group, glm.moe.first_dense_layers) == ("sigmoid", 2, 1)
    ds = load_model(saved("deepseek_v3-a")).spec
    assert ds.mla is not None and (ds.mla.kv_lora_rank, ds.mla.q_lora_rank, ds.rotary_dim) == (16, 24, 8)
    # the latent cache: kv_lora_rank + qk_rope_head_dim numbers per token per layer, fp32
    assert ds.kv_bytes_per_token(4.0) == 3 * (16 + 8) * 4
    runner = build_torch_runner(ds, load_model(saved("deepseek_v3-a")).weights, kv_tokens=64, block_size=BLOCK)
    assert runner.ops.kv_bytes == 64 * 3 * (16 + 8) * 4  # what the backend allocates
    oss = load_model(saved("gpt_oss-a")).spec
    assert oss.attention_sinks and oss.window(0) == 4 and oss.window(1) is None
    assert oss.moe is not None and oss.moe.swiglu_limit == 7.0 and oss.moe.router_bias


def test_kimi_k2_config_runs_as_deepseek_v3(tmp_path: Path) -> None:
    folder = tmp_path / "kimi"
    hf_model("deepseek_v3-a").save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"model_type": "kimi_k2"}))
    assert load_model(folder).spec.model_type == "deepseek_v3"
    assert max_error("deepseek_v3-a", "torch", folder) <= TOL


def test_mtp_layer_is_skipped_by_name(tmp_path: Path) -> None:
    from safetensors.numpy import load_file, save_file

    folder = tmp_path / "mtp"
    hf_model("deepseek_v3-a").save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"num_nextn_predict_layers": 1}))
    state = load_file(str(folder / "model.safetensors"))
    state["model.layers.3.eh_proj.weight"] = np.zeros((64, 128), np.float32)  # layer N: the MTP layer
    state["model.layers.3.self_attn.kv_a_layernorm.weight"] = np.ones(16, np.float32)
    save_file(state, str(folder / "model.safetensors"))
    loaded = load_model(folder)
    assert not any(name.startswith("layers.3.") for name in loaded.weights.names())


@pytest.mark.parametrize("backend", sorted(BUILDERS))
def test_gpt_oss_mxfp4_checkpoint(tmp_path: Path, backend: str) -> None:
    """The published layout: experts as MXFP4 `*_blocks`/`*_scales` [E, out, in/32, 16] / [E, out, in/32]
    (packed here by quant/mxfp4.py from the OCP specification), against transformers on the
    dequantized experts."""
    import copy

    from safetensors.numpy import save_file

    from twinfer.formats import mxfp4

    model = copy.deepcopy(hf_model("gpt_oss-a"))
    state = {k: v.detach().float().numpy().copy() for k, v in model.state_dict().items()}
    for key in [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        packed = [mxfp4.pack(np.ascontiguousarray(w.T)) for w in state.pop(key)]  # [E, in, out] -> [out, in]
        state[key + "_blocks"] = np.ascontiguousarray(np.stack([p.blocks for p in packed]))
        state[key + "_scales"] = np.ascontiguousarray(np.stack([p.scales for p in packed]))
        dequantized = np.stack([p.unpack().T for p in packed])  # back to transformers' [E, in, out]
        with torch.no_grad():
            model.get_parameter(key).copy_(torch.from_numpy(dequantized))
    folder = tmp_path / "mxfp4"
    folder.mkdir()
    save_file(state, str(folder / "model.safetensors"))
    config = json.loads(model.config.to_json_string())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (folder / "config.json").write_text(json.dumps(config))
    weights = load_model(folder).weights
    assert weights.dtype_stored("layers.0.experts.gate") == "U8"
    assert max_error("gpt_oss-a", backend, folder, reference=model) <= TOL


def _char_tokenizer(folder: Path) -> None:
    """A 97-token character tokenizer, so the corpus runs through a tiny model's vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {chr(32 + i): i for i in range(95)} | {"<unk>": 95, "<s>": 96}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>").save_pretrained(folder)


@pytest.mark.parametrize(("case", "backend"), [
    ("glm4_moe-a", "torch"), ("deepseek_v3-a", "torch"), ("gpt_oss-a", "torch"), ("gpt_oss-a", "mlx"),
    pytest.param("glm4_moe-a", "mlx", marks=pytest.mark.slow), pytest.param("deepseek_v3-a", "mlx", marks=pytest.mark.slow),
])  # fmt: skip
def test_eval_kl_against_transformers(tmp_path: Path, case: str, backend: str) -> None:
    folder = tmp_path / case
    hf_model(case).save_pretrained(folder)
    _char_tokenizer(folder)
    args = ["eval", "kl", str(folder), "--reference", "transformers", "--candidate", backend,
            "--tokens", "96", "--window", "48", "--json"]
    result = subprocess.run([sys.executable, "-c", "from twinfer.cli.main import main; main()", *args],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("{")))
    assert report["tokens"] >= 90 and report["mean_kl"] <= 1e-5 and report["top1_agreement"] == 1.0


@pytest.mark.parametrize(("key", "value", "error"), [
    ("index_topk", 2048, UnsupportedArchitecture), ("topk_method", "greedy", UnsupportedArchitecture),
    # a quantization method is the published-layout loader's refusal, not the architecture's
    ("quantization_config", {"quant_method": "bitsandbytes"}, QuantConfigError)])
def test_unimplemented_fields_are_refused_by_name(tmp_path: Path, key: str, value: Any, error: type) -> None:
    folder = tmp_path / "bad"
    hf_model("deepseek_v3-b").save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {key: value}))
    with pytest.raises(error) as info:
        load_model(folder)
    assert key in str(info.value) and "\n" not in str(info.value)
