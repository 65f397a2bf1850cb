"""A local plan's llama.cpp placement: what the plan names, what the runner's model parameters get, what
llama.cpp then does with them, and what a plan says when the installed build cannot offload.

Hardware is always described and the llama.cpp build pinned ($TWINFER_LLAMACPP_BUILD), so no verdict
depends on this machine; the runner tests load a random MoE GGUF on whatever build is installed (a
CPU-only build takes n_gpu_layers and places the overridden tensors in its CPU buffer all the same).
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.random_moe_gguf import MoEShape, write_random_moe_gguf
from twinfer.planners import catalog
from twinfer.planners.cost import Strategy
from twinfer.planners.describe import resolve_cluster
from twinfer.planners.formats import KV_FORMATS, MIXES
from twinfer.planners.hardware import APPLE, CPU, GPU
from twinfer.planners.llamacpp_build import BUILD_ENV
from twinfer.planners.placement import ALL_LAYERS, Placement, build_refusal, parse_build, placement_for
from twinfer.planners.search import STREAM_SHARES

ROOT = Path(__file__).resolve().parent.parent
GPU_BUILD, CPU_BUILD = "CPU,CUDA", "CPU"
RTX = "gpu:memory=8GB,bandwidth=400GB/s,bf16=100,label=Test GPU"
SHAPE = MoEShape(layers=4, experts=8, top_k=2)


def _plan_cli(*args: str, build: str) -> str:
    env = {**os.environ, BUILD_ENV: build,
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-m", "twinfer.cli.main", "plan", *args], capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


# -- the plan -----------------------------------------------------------------------------------------
def test_gpt_oss_on_an_rtx_4070_names_the_llamacpp_parameters_it_runs() -> None:
    text = _plan_cli("gpt-oss-20b", "--hardware", "rtx-4070", build=GPU_BUILD)
    plan = json.loads(_plan_cli("gpt-oss-20b", "--hardware", "rtx-4070", "--json", build=GPU_BUILD))
    share, kv = plan["moe"]["streamed_share"], plan["kv_format"]
    n = math.ceil(share * 24)  # gpt-oss-20b: 24 layers, every one MoE
    assert plan["engine"] == "llamacpp" and 0 < share < 1  # 13 GB of weights on a 12 GB card: experts stream
    kv_args = f" --cache-type-k {kv} --cache-type-v {kv}" if kv != "f16" else ""
    args = f"--n-gpu-layers {ALL_LAYERS} --n-cpu-moe {n}{kv_args}"
    assert plan["llamacpp"] == {
        "device": GPU, "n_gpu_layers": ALL_LAYERS, "cpu_moe_layers": n, "kv_type": kv, "args": args,
        "tensor_overrides": [rf"blk\.({'|'.join(map(str, range(n)))})\.ffn_(up|down|gate|gate_up)_(ch|)exps=CPU"],
    }
    assert f"llama.cpp {args}  (routed experts of the first {n} of 24 layers in host memory)" in text.splitlines()
    assert "cannot offload" not in text
    # what stays on the card is no more than the plan priced: whole blocks of experts go to host memory
    routed = plan["moe"]["streamed_bytes"] / share
    assert n / 24 * routed >= plan["moe"]["streamed_bytes"]


def test_a_cpu_only_build_says_it_cannot_run_a_gpu_plan() -> None:
    text = _plan_cli("gpt-oss-20b", "--hardware", "rtx-4070", build=CPU_BUILD)
    warnings = [line for line in text.splitlines() if "cannot offload" in line]
    assert len(warnings) == 1
    assert ("the installed llama-cpp-python is a CPU-only build and cannot offload to the NVIDIA GeForce RTX 4070"
            in warnings[0])
    assert "the numbers above assume a GPU build" in warnings[0] and '-DGGML_CUDA=on' in warnings[0]
    assert any(line.startswith("llama.cpp --n-gpu-layers 999 --n-cpu-moe ") for line in text.splitlines())


def test_the_host_with_a_gpu_this_build_cannot_use_is_planned_on_its_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TWINFER_HOST_FACTS", str(ROOT / "tests" / "hosts" / "apple-m2-max.json"))
    monkeypatch.setenv(BUILD_ENV, CPU_BUILD)
    cluster = resolve_cluster("auto")
    assert cluster.device.kind == CPU and cluster.llamacpp_build is None
    assert any("found Apple M2 Max" in n and "CPU-only build" in n and "planned on the CPU" in n for n in cluster.notes)
    found = resolve_cluster("auto", follow_build=False)  # `twinfer hw`: what is there
    assert found.device.kind == APPLE and found.llamacpp_build == parse_build(CPU_BUILD)
    monkeypatch.setenv(BUILD_ENV, "CPU,Metal")
    metal = resolve_cluster("auto")
    assert metal.device.kind == APPLE and metal.llamacpp_build is not None
    assert metal.llamacpp_build.backend_for(metal.device) == "Metal"


def test_hw_says_which_build_is_installed_and_whether_it_runs_the_device(monkeypatch: pytest.MonkeyPatch,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    from twinfer.cli.hw_cmd import run_hw

    monkeypatch.setenv(BUILD_ENV, CPU_BUILD)
    run_hw(False, False, False, "rtx-4070")
    out = capsys.readouterr().out.splitlines()
    assert "build       llama-cpp-python pinned: ggml backends CPU (no GPU offload)" in out
    assert any(line.strip().startswith("a CPU-only build: cannot use this gpu") for line in out)
    monkeypatch.setenv(BUILD_ENV, GPU_BUILD)
    run_hw(False, True, False, "rtx-4070")
    build = json.loads(capsys.readouterr().out)["llamacpp_build"]
    assert build == {"version": "pinned", "backends": ["CPU", "CUDA"], "gpu_offload": True, "devices": [],
                     "runs_device": True}


def test_streamed_shares_keep_whole_blocks_of_experts_after_the_dense_ones() -> None:
    profile = catalog.find("deepseek-v3").profile()  # 61 layers, the first 3 dense
    device = resolve_cluster(RTX).device
    mix, kv = MIXES["q4_k_m"], KV_FORMATS["q8_0"]
    for share in STREAM_SHARES:
        p = placement_for(profile, Strategy(mix, kv, "llamacpp", stream_fraction=share), device)
        assert p is not None
        n = 3 + math.ceil(share * 58)
        assert (p.device, p.n_gpu_layers, p.cpu_moe_layers, p.kv_type) == (GPU, ALL_LAYERS, n, "q8_0")
        (pattern,) = p.overrides()
        held = {i for i in range(61) for t in ("up", "gate", "down")
                if re.search(pattern, f"blk.{i}.ffn_{t}_exps.weight")}
        assert held == set(range(n))
        assert not any(re.search(pattern, f"blk.0.{t}.weight") for t in ("ffn_up_shexp", "attn_q", "ffn_gate_inp"))
        assert (n - 3) / 58 >= share
    whole = placement_for(profile, Strategy(mix, kv, "llamacpp", stream_fraction=1.0), device)
    assert whole is not None and whole.overrides() == (r"\.ffn_(up|down|gate|gate_up)_(ch|)exps",)
    assert whole.args() == "--n-gpu-layers 999 --cpu-moe --cache-type-k q8_0 --cache-type-v q8_0"
    cpu = placement_for(profile, Strategy(mix, kv, "llamacpp", stream_fraction=0.5), resolve_cluster("cpu").device)
    assert cpu == Placement(CPU, 0, 61, 0, "q8_0") and cpu.args() == "--n-gpu-layers 0 --cache-type-k q8_0 --cache-type-v q8_0"
    assert placement_for(profile, Strategy(MIXES["fp8"], KV_FORMATS["bf16"], "torch"), device) is None
    assert build_refusal(parse_build(CPU_BUILD), cpu, device) == ""  # a CPU placement runs on every build


# -- the runner ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def moe_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_moe_gguf(tmp_path_factory.mktemp("placement") / "moe.gguf", SHAPE)


class LlamaLog:
    """llama.cpp's log, debug lines included, captured in place of the runner's quieting callback."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self._callback = None

    def set_quiet(self, lib: object, quiet: bool) -> None:
        self._callback = lib.llama_log_callback(  # type: ignore[attr-defined]
            lambda level, text, data: self.lines.append(text.decode("utf-8", "replace")))
        lib.llama_log_set(self._callback, ctypes.c_void_p(0))  # type: ignore[attr-defined]

    def overridden(self) -> dict[str, str]:
        """tensor -> buffer type, from llama.cpp's "buffer type overridden" lines."""
        found = (re.match(r"tensor (\S+) \(.*\) buffer type overridden to (\S+)", line) for line in self.lines)
        return {m.group(1): m.group(2) for m in found if m}


@pytest.fixture
def llama_log(monkeypatch: pytest.MonkeyPatch) -> object:
    from twinfer.backends.llamacpp import _lib, runner

    log = LlamaLog()
    monkeypatch.setattr(runner, "set_quiet", log.set_quiet)
    yield log
    _lib.set_quiet(_lib.load_llama_cpp(), True)  # the next runner quiets it again anyway; do it now


def _streaming_budget(loaded: object, cluster: object) -> tuple[int, object]:
    """The largest budget (in 20 kB steps below the whole model's) at which the plan keeps experts off the
    device: in host memory beside a GPU, paged from the file (or the file requantized) on a CPU."""
    from twinfer.app.budget import llamacpp_strategy

    whole = llamacpp_strategy(loaded, 10**12, 256, 1, False, cluster)  # type: ignore[arg-type]
    budget = whole.predicted_bytes
    for _ in range(40):
        budget -= 20_000
        s = llamacpp_strategy(loaded, budget, 256, 1, False, cluster)  # type: ignore[arg-type]
        if s.placement is not None and (s.placement.cpu_moe_layers or s.expert_cache_bytes is not None
                                        or s.requantize):
            return budget, s
    raise AssertionError("no budget made the plan stream experts")


def test_a_budget_on_a_described_gpu_opens_the_runner_with_the_plans_placement(
        moe_gguf: Path, llama_log: LlamaLog, monkeypatch: pytest.MonkeyPatch) -> None:
    from twinfer.app.session import OpenOptions, open_session
    from twinfer.runtime.loaders import load_model

    monkeypatch.setenv(BUILD_ENV, GPU_BUILD)
    cluster = resolve_cluster(RTX)
    budget, planned = _streaming_budget(load_model(moe_gguf), cluster)
    session = open_session(OpenOptions(str(moe_gguf), "llamacpp", ctx=256, memory_budget=str(budget), hardware=cluster))
    try:
        p = session.strategy.placement if session.strategy else None
        assert p == planned.placement and p is not None  # type: ignore[attr-defined]
        n = p.cpu_moe_layers
        assert 0 < n < SHAPE.layers and p.n_gpu_layers == ALL_LAYERS
        info = session.opened.runner.describe()
        assert info["placement"] == {"n_gpu_layers": ALL_LAYERS, "tensor_overrides": [f"{o}=CPU" for o in p.overrides()]}
        assert info["kv_type"] == p.kv_type
        experts = {f"blk.{i}.ffn_{t}_exps.weight": "CPU" for i in range(n) for t in ("gate", "up", "down")}
        assert llama_log.overridden() == experts  # llama.cpp placed exactly those, and nothing else
    finally:
        session.close()


def test_a_budget_on_a_cpu_places_no_layer_on_a_gpu(moe_gguf: Path, llama_log: LlamaLog,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU plan that keeps experts out of memory pages them from the file; on any build, no layer goes
    to a GPU (llama.cpp's default on a GPU build would put all of them there)."""
    from twinfer.app.session import OpenOptions, open_session
    from twinfer.runtime.loaders import load_model

    monkeypatch.setenv(BUILD_ENV, GPU_BUILD)
    cluster = resolve_cluster("cpu")
    budget, planned = _streaming_budget(load_model(moe_gguf), cluster)
    session = open_session(OpenOptions(str(moe_gguf), "llamacpp", ctx=256, memory_budget=str(budget), hardware=cluster))
    try:
        assert session.strategy is not None and session.strategy.placement == planned.placement  # type: ignore[attr-defined]
        assert session.strategy.placement == Placement(CPU, 0, SHAPE.layers, kv_type=session.strategy.kv_type or "f16")
        assert session.opened.runner.describe()["placement"] == {"n_gpu_layers": 0, "tensor_overrides": []}
        assert llama_log.overridden() == {}
    finally:
        session.close()


def test_without_a_placement_the_runner_keeps_llamacpps_defaults(moe_gguf: Path, llama_log: LlamaLog) -> None:
    from twinfer.backends.llamacpp.options import LlamaCppOptions
    from twinfer.backends.llamacpp.runner import LlamaCppRunner

    with LlamaCppRunner(moe_gguf, LlamaCppOptions(n_ctx=256, max_seqs=1)) as plain:
        assert plain.describe()["placement"] == {"n_gpu_layers": None, "tensor_overrides": []}
    on_cpu = Placement(CPU, 0, SHAPE.layers, kv_type="q8_0")
    with LlamaCppRunner(moe_gguf, LlamaCppOptions(n_ctx=256, max_seqs=1, kv_type="q8_0", placement=on_cpu)) as cpu:
        assert cpu.describe()["placement"] == {"n_gpu_layers": 0, "tensor_overrides": []}
        assert cpu.describe()["device"] == "cpu"
    assert llama_log.overridden() == {}
    with pytest.raises(ValueError, match="placement's KV type q8_0 is not kv_type f16"):
        LlamaCppOptions(n_ctx=256, placement=on_cpu)


def test_the_installed_build_is_read_from_ggmls_registry() -> None:
    import llama_cpp

    from twinfer.planners.llamacpp_build import _installed

    build = _installed()
    assert build is not None and "CPU" in build.backends and build.version == llama_cpp.__version__
    assert build.backend_for(resolve_cluster("cpu").device) == "CPU"
