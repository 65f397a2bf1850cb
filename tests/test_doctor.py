"""`twinfer doctor`: every lossless stage passes on the default model and on a tiny random model of
every architecture (about 5 s each); a fault injected into one stage (one layer's output scaled) is
named as the first divergence; the result records hardware, library versions and the git revision.
"""

from __future__ import annotations

import json
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from fixtures_models import HF_CONFIGS  # noqa: E402

from twinfer.app.doctor import DoctorReport, run_doctor  # noqa: E402
from twinfer.app.doctor_stages import FAULT_ENV  # noqa: E402

DEEPSEEK = dict(vocab_size=98, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=4,
                n_shared_experts=1, num_experts_per_tok=2, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16,
                v_head_dim=12, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=None,
                n_group=1, topk_group=1, first_k_dense_replace=1, max_position_embeddings=256,
                rope_parameters=dict(rope_type="default", rope_theta=10000.0))


def _char_tokenizer(folder: Path) -> None:
    """A 97-token character tokenizer, so text runs through a tiny model's vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {chr(32 + i): i for i in range(95)} | {"<unk>": 95, "<s>": 96}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>").save_pretrained(folder)


@cache
def tiny(arch: str, root: str) -> Path:
    import torch

    folder = Path(root) / arch
    torch.manual_seed(0)
    if arch == "deepseek_v3":
        model: Any = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**DEEPSEEK))
    elif arch in SEED_CASES:  # the seeds' MoE architectures, as test_arch_logits builds them
        from test_arch_logits import BASE, CASES

        prefix, kwargs = CASES[SEED_CASES[arch]]
        config = getattr(transformers, f"{prefix}Config")(**{**BASE, **kwargs, "vocab_size": 98})
        model = getattr(transformers, f"{prefix}ForCausalLM")(config)
    else:  # the suite's tiny config, with room for the character tokenizer (98: TP=2 splits it)
        config_cls, model_cls, kwargs = HF_CONFIGS[arch]
        model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**{**kwargs, "vocab_size": 98}))
    model.save_pretrained(folder)
    _char_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("doctor"))


def _by_name(report: DoctorReport) -> dict[str, Any]:
    return {s.stage: s for s in report.stages}


def assert_lossless_pass(report: DoctorReport) -> None:
    ran = [s for s in report.stages if not s.skipped and s.base is not None]
    assert ran, report.lines()
    for s in ran:
        assert s.passed, "\n".join(report.lines())
    assert report.first_divergence is None


PROMPT = "The quick brown fox jumps over the lazy dog; def f(x): return x * 2"


SEED_CASES = {"glm4_moe": "glm4_moe-a", "gpt_oss": "gpt_oss-b"}
ARCHS = ["llama", *[a for a in HF_CONFIGS if a != "llama"], "deepseek_v3", *SEED_CASES]


@pytest.mark.parametrize("arch", ARCHS)
def test_doctor_tiny_models_pass_every_lossless_stage(arch: str, root: str) -> None:
    report = run_doctor(str(tiny(arch, root)), PROMPT, tokens=48)
    stages = _by_name(report)
    assert_lossless_pass(report)
    for name in ("reference", "torch", "mlx", "torch batched", "torch + ngram speculation"):
        assert not stages[name].skipped, (name, stages[name].skipped)
    assert stages["torch"].mean_kl <= 1e-6 and stages["torch"].greedy_identical
    assert stages["TP=2 (gloo)"].passed if not stages["TP=2 (gloo)"].skipped else True
    assert "llama.cpp" not in stages  # a safetensors folder has no GGUF runner


def _new_family(name: str, root: str) -> Path:
    """A tiny checkpoint of a newer family, from its own test's builder, with the character tokenizer."""
    folder = Path(root) / name
    if name == "qwen3_next":
        from test_arch_hybrid import hf_model as hybrid_model

        hybrid_model("next-a").save_pretrained(folder)
    else:
        from test_arch_today_moe import minimax_model

        minimax_model("minimax_m2-a").save_pretrained(folder)
    _char_tokenizer(folder)
    return folder


@pytest.mark.parametrize("name", ["qwen3_next", pytest.param("minimax_m2", marks=pytest.mark.slow)])
def test_doctor_new_families_run_their_lossless_stages(name: str, root: str) -> None:
    """MiniMax-M2 and the recurrent Qwen3-Next pass every lossless stage, TP=2 and EP=2 and n-gram
    speculation (the recurrent state taken back past rejected drafts) included."""
    stages = _by_name(report := run_doctor(str(_new_family(name, root)), PROMPT, tokens=32))
    assert_lossless_pass(report)
    for stage in ("torch", "mlx", "TP=2 (gloo)", "EP=2 (gloo)", "torch batched"):
        assert stages[stage].passed and stages[stage].greedy_identical, "\n".join(report.lines())
    speculation = stages["torch + ngram speculation"]
    assert speculation.passed and speculation.greedy_identical, "\n".join(report.lines())


def test_doctor_tiny_moe_splits_experts(root: str) -> None:
    """qwen3_moe: TP=2 and EP=2 over gloo are lossless (the all-reduce order only)."""
    report = run_doctor(str(tiny("qwen3_moe", root)), PROMPT, tokens=32,
                        skip=("mlx", "torch greedy", "torch + ngram speculation"))
    stages = _by_name(report)
    for name in ("TP=2 (gloo)", "EP=2 (gloo)"):
        assert not stages[name].skipped and stages[name].passed and stages[name].mean_kl <= 1e-6, report.lines()


def test_injected_fault_is_named(root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAULT_ENV, "mlx:1")
    report = run_doctor(str(tiny("llama", root)), PROMPT, tokens=32,
                        skip=("torch greedy", "torch + ngram speculation", "TP=2 (gloo)"))
    first = report.first_divergence
    assert first is not None and first.stage == "mlx" and first.base == "torch", report.lines()
    assert "injected fault" in first.note and first.mean_kl > 100 * first.max_kl
    assert any(line.startswith("first divergence: mlx") for line in report.lines())


@pytest.mark.slow
def test_doctor_default_model_cli_json(tmp_path: Path) -> None:
    out = tmp_path / "doctor.json"
    args = ["doctor", "--tokens", "32", "--json", str(out)]
    r = subprocess.run([sys.executable, "-c", "from twinfer.cli.main import main; main()", *args],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    data = json.loads(out.read_text())
    stages = {s["stage"]: s for s in data["stages"]}
    assert data["first_divergence"] is None
    for name in ("torch", "mlx", "llama.cpp", "torch batched", "llamacpp + ngram speculation"):
        assert stages[name]["passed"] is True, stages[name]
    assert stages["torch"]["mean_kl"] <= 1e-6  # the same dequantized weights in fp32 as transformers
    assert stages["llama.cpp"]["mean_kl"] <= 0.01  # llama.cpp's quantized activations
    ctx = data["context"]
    assert ctx["twinfer_revision"] != "unknown" and "llama_cpp_python" in ctx["libraries"] and ctx["hardware"]


def test_doctor_records_whether_llamacpp_amx_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    import twinfer.backends.llamacpp.amx as amx
    from twinfer.app.doctor import llamacpp_amx

    monkeypatch.setattr(amx, "cpu_has_amx", lambda: False)
    monkeypatch.setattr(amx, "amx_verdict", lambda: pytest.fail("no AMX: nothing to probe"))
    assert llamacpp_amx().startswith("none")
    monkeypatch.setattr(amx, "cpu_has_amx", lambda: True)
    for verdict, words in (("off", "crash on this CPU"), ("on", "run here")):
        monkeypatch.setattr(amx, "amx_verdict", lambda v=verdict: v)
        assert words in llamacpp_amx()
    lines = DoctorReport("m", 4, [], {"llamacpp_amx": llamacpp_amx()}).lines()
    assert lines[-1] == "llama.cpp AMX: on (its AMX kernels run here)"
