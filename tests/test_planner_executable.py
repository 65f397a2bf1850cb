"""Plans are executable: the planner's bytes are what the runners load and allocate, and every strategy
it chooses from the catalog is one the engine it names runs for that architecture and format.

The tiny checkpoints are test_arch_logits' (glm4_moe, deepseek_v3, gpt_oss from transformers configs).
Hardware is always pinned: table rows, node shapes and described CPUs, never the probed host.
"""

from __future__ import annotations

import pytest

from twinfer.planners import catalog
from twinfer.planners.cost import Strategy
from twinfer.planners.describe import resolve_cluster
from twinfer.planners.executable import refusal
from twinfer.planners.formats import KV_FORMATS, MIXES
from twinfer.planners.hardware import CPU, Cluster, Device
from twinfer.planners.memory import kv_alloc_per_token
from twinfer.planners.plan import make_plan
from twinfer.planners.search import Request
from twinfer.planners.source import profile_from_loaded
from twinfer.runtime.loaders import load_model

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_arch_logits import saved  # noqa: E402

from twinfer.backends.cuda.runner import load_torch_runner  # noqa: E402

CASES = ["glm4_moe-a", "glm4_moe-b", "deepseek_v3-a", "deepseek_v3-b", "deepseek_v3-c", "gpt_oss-a", "gpt_oss-b"]
KV_TOKENS = 256


@pytest.mark.parametrize("case", CASES)
def test_weight_and_kv_bytes_are_what_the_torch_runner_holds(case: str) -> None:
    loaded = load_model(saved(case))
    profile = profile_from_loaded(loaded)
    runner = load_torch_runner(loaded, kv_tokens=KV_TOKENS, block_size=16)
    held = sum(int(t.nbytes) for t in runner.weights.values() if isinstance(t, torch.Tensor))
    planned = profile.weight_bytes(profile.stored)  # fp32 as stored = fp32 as the CPU runner holds it
    assert abs(planned - held) <= 0.02 * held, (planned, held)
    s = Strategy(profile.stored, KV_FORMATS["f32"], "torch")  # type: ignore[arg-type]
    assert kv_alloc_per_token(profile, s, KV_TOKENS) * KV_TOKENS == runner.ops.kv_bytes  # exactly


def test_mla_latent_is_priced_per_token_and_replicated_under_tp() -> None:
    ds = load_model(saved("deepseek_v3-a")).spec
    assert ds.mla is not None
    s = Strategy(MIXES["bf16"], KV_FORMATS["f32"], "torch")
    per_token = kv_alloc_per_token(profile_from_loaded(load_model(saved("deepseek_v3-a"))), s, 64)
    assert per_token == ds.num_layers * (ds.mla.kv_lora_rank + ds.mla.qk_rope_head_dim) * 4
    plan = make_plan(catalog.find("deepseek-v3").profile(), resolve_cluster("hgx-h200"), Request(4096, 1))
    j = plan.to_json()
    assert plan.fits and j["parallelism"]["tp"] > 1
    mem = j["memory"]
    assert mem["mla_latent_cache"] == "replicated" and mem["kv_split_ways"] == j["parallelism"]["pp"]
    assert mem["kv_bytes_per_device"] == pytest.approx(mem["kv_bytes_per_token"] * 4096 / j["parallelism"]["pp"])
    assert any("latent cache is replicated" in r for r in plan.reasons)


def _cpu(label: str, memory: float, bandwidth: float, f32: float, int8: float) -> Device:
    return Device(name="cpu", label=label, vendor="cpu", kind=CPU, memory_gb=memory, bandwidth_gbs=bandwidth,
                  memory_type="ddr", interconnect_gbs=0.0, link="none",
                  tensor_tflops=(("f32", f32), ("int8", int8)), vector_tflops=f32, clock_ghz=3.0,
                  source="test shape", storage_gbs=2.0)


HARDWARE: list[str | Device] = [
    "h100", "h200", "b200", "a100", "l40s", "rtx-4090", "rtx-3060", "hgx-h100", "hgx-h200", "dgx-h100",
    "gpu:memory=192GB,bandwidth=8TB/s,fp4=10PFLOPS,memory_type=hbm,link=nvlink5,max_per_node=8",
    "apple:memory=128GB,bandwidth=400GB/s,vector=13.6TFLOPS",
    _cpu("2-core AVX2 laptop", 16, 20, 0.19, 0.38), _cpu("16-core AVX-512 server", 512, 120, 2.4, 9.6),
]
ARCHS = ("deepseek_v3", "deepseek_v32", "glm4_moe", "glm_moe_dsa", "gpt_oss", "minimax_m2")


# the default run's share of HARDWARE: each target, a node, a GPU without native FP8, Apple, a CPU
QUICK: list[str | Device] = ["h200", "b200", "rtx-3060", "hgx-h200", *HARDWARE[10:13]]


def test_every_catalog_plan_is_one_its_engine_runs() -> None:
    """Datacenter and local targets, one to several GPUs, batch 1 and 64: the chosen strategy is never one
    the engine it names refuses (TurboQuant KV under MLA or sinks, an FP8 KV cache on torch, GGUF
    weights on torch, a non-native format on a GPU)."""
    _walk(QUICK)


@pytest.mark.slow
def test_every_catalog_plan_on_every_shape_is_one_its_engine_runs() -> None:
    _walk(HARDWARE)


def _walk(hardware: list[str | Device]) -> None:
    walked: set[tuple[str, str, str]] = set()
    for entry in catalog.ENTRIES:
        if entry.spec.model_type not in ARCHS:
            continue
        profile = entry.profile()
        for hw in hardware:
            cluster = resolve_cluster(hw) if isinstance(hw, str) else Cluster(hw)
            for context, concurrency in ((4096, 1), (32768, 64)):
                plan = make_plan(profile, cluster, Request(min(context, entry.spec.max_position), concurrency))
                if plan.strategy is None:
                    continue
                assert refusal(profile, plan.strategy, cluster.device) == "", (entry.name, hw, plan.strategy.label())
                walked.add((entry.spec.model_type, plan.target, plan.strategy.engine))
    assert {(a, t) for a, t, _ in walked} >= {(a, t) for a in ARCHS for t in ("local", "datacenter")}
    assert {e for _, _, e in walked} >= {"torch", "llamacpp"}


@pytest.mark.parametrize(("case", "kv", "why"), [
    ("deepseek_v3-a", "tq4", "latent attention"), ("gpt_oss-a", "tq4", "attention sinks"),
])  # fmt: skip
def test_refusals_match_the_runner(case: str, kv: str, why: str) -> None:
    """The planner's refusal and the runner's agree: the torch runner refuses the same KV format."""
    from twinfer.backends.cuda.runner import build_torch_runner
    from twinfer.runtime.synthetic import greedy_tokens

    loaded = load_model(saved(case))
    profile = profile_from_loaded(loaded)
    assert why in refusal(profile, Strategy(profile.stored, KV_FORMATS[kv], "torch"),  # type: ignore[arg-type]
                          resolve_cluster("h100").device)
    runner = build_torch_runner(loaded.spec, loaded.weights, kv_tokens=64, kv_format=kv)
    with pytest.raises(ValueError, match=why):
        greedy_tokens(runner, [1, 2, 3], 1)
