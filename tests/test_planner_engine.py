"""The planner's weight and KV bytes against what twinfer's runners allocate, within 2%.

The allocations come from the engines, not from the planner's code: the torch runner's weight tensors
and KV caches; for llama.cpp, `llama_model_size` (its loaded tensors), the KV buffers it logs when it
creates a context, and how much a sequence's saved state grows per token. The planner is asked for
the formats each runner holds (`runner_formats`), or left to choose (`auto`) and the runner is then
built with the KV type the plan names.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from pinned_host import pinned_cpu  # noqa: E402

from twinfer.planners.hardware import CPU, Cluster
from twinfer.planners.plan import make_plan, runner_formats
from twinfer.planners.search import Request
from twinfer.planners.source import resolve

TOL = 0.02  # the bound we hold the planner to; llama.cpp's log rounds MiB to two decimals, its state adds ~24 B per cell


def planned(model: str | Path, context: int, weights: str, kv: str, cluster: Cluster | None = None) -> dict[str, Any]:
    plan = make_plan(resolve(str(model)), cluster if cluster is not None else pinned_cpu(), Request(context, 1, weights, kv)).to_json()
    assert plan["fits"]
    return plan


# -- llama.cpp runner ------------------------------------------------------------------------------
@contextmanager
def llama_log() -> Iterator[list[str]]:
    """llama.cpp's log lines for runners created inside the block (instead of the runner's silence)."""
    pytest.importorskip("llama_cpp")
    import ctypes

    import twinfer.backends.llamacpp.runner as runner_module
    from twinfer.backends.llamacpp._lib import load_llama_cpp, set_quiet

    lib = load_llama_cpp()
    lines: list[str] = []
    sink = lib.llama_log_callback(lambda level, text, user_data: lines.append(text.decode("utf-8", "replace")))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(runner_module, "set_quiet", lambda lib, quiet: lib.llama_log_set(sink, ctypes.c_void_p(0)))
        try:
            yield lines
        finally:
            set_quiet(lib, True)  # llama.cpp must stop calling `sink` before it is freed


def kv_buffer_bytes(lines: list[str]) -> float:
    """Sum of the `KV buffer size = X MiB` lines llama.cpp logs (one per cache: full and sliding layers)."""
    sizes = re.findall(r"KV buffer size\s*=\s*([\d.]+) MiB", "".join(lines))
    assert sizes, "llama.cpp logged no 'KV buffer size' line: its log format changed; read the allocation anew"
    return sum(float(s) for s in sizes) * 2**20


def state_bytes_per_token(runner: Any, tokens: int = 16) -> float:
    """Growth of one sequence's saved state per decoded token: what one KV cell holds, as llama.cpp stores it."""
    from twinfer.runtime.batch import LogitsWanted, SeqChunk, StepBatch

    lib, ctx = runner._lib, runner._ctx  # the runner exposes no state API; read llama.cpp's directly
    sizes = []
    for i in range(2):
        ids = [100 + i * tokens + t for t in range(tokens)]
        runner.step(StepBatch([SeqChunk(0, ids, i * tokens, logits=LogitsWanted.NONE)]))
        sizes.append(int(lib.llama_state_seq_get_size(ctx, 0)))
    runner.release(0)
    return (sizes[1] - sizes[0]) / tokens


def test_llamacpp_weights_equal_the_loaded_tensors(default_model: Path) -> None:
    from twinfer.backends.llamacpp import LlamaCppOptions, LlamaCppRunner

    plan = planned(default_model, 1024, *runner_formats("llamacpp", CPU))
    with LlamaCppRunner(default_model, LlamaCppOptions(n_ctx=256, max_seqs=1, n_threads=2)) as runner:
        loaded = int(runner._lib.llama_model_size(runner._model))
    assert plan["memory"]["weights_bytes"] == pytest.approx(loaded, rel=TOL)
    assert loaded == 246_587_904  # Gemma 3 270M Q4_K_M: llama.cpp's count, independent of the planner


@pytest.mark.parametrize("kv_type,context", [("f16", 256), ("f16", 2048), ("q8_0", 2048), ("q4_0", 1024)])
def test_llamacpp_kv_bytes_per_token_match_the_plan(default_model: Path, kv_type: str, context: int) -> None:
    # past 512 tokens Gemma 3's sliding layers would hold only their window; the runner keeps them whole
    from twinfer.backends.llamacpp import LlamaCppOptions, LlamaCppRunner

    plan = planned(default_model, context, "stored", kv_type)
    assert plan["kv_format"] == kv_type
    with llama_log() as lines:
        runner = LlamaCppRunner(default_model, LlamaCppOptions(n_ctx=context, max_seqs=1, n_threads=2, kv_type=kv_type))
    with runner:
        allocated = kv_buffer_bytes(lines) / runner.n_ctx
        stored = state_bytes_per_token(runner)
    per_token = plan["memory"]["kv_bytes_per_token"]
    assert per_token == pytest.approx(allocated, rel=TOL)
    assert per_token == pytest.approx(stored, rel=TOL)
    assert runner.n_ctx == context  # multiples of 256 are not rounded: the per-token figure is the whole story


@pytest.mark.parametrize("context", [256, 4096])
def test_llamacpp_runner_allocates_the_kv_format_the_planner_chooses(default_model: Path, context: int) -> None:
    from twinfer.backends.llamacpp import LlamaCppOptions, LlamaCppRunner

    plan = planned(default_model, context, "auto", "auto")
    assert plan["engine"] == "llamacpp" and plan["weights_format"] == "stored"
    with llama_log() as lines:
        runner = LlamaCppRunner(default_model, LlamaCppOptions(n_ctx=context, max_seqs=1, n_threads=2, kv_type=plan["kv_format"]))
    with runner:
        allocated = kv_buffer_bytes(lines) / runner.n_ctx
    assert plan["memory"]["kv_bytes_per_token"] == pytest.approx(allocated, rel=TOL)


def test_llamacpp_runner_rejects_kv_types_it_cannot_hold(default_model: Path) -> None:
    pytest.importorskip("llama_cpp")
    from twinfer.backends.llamacpp import LlamaCppOptions, LlamaCppRunner

    with pytest.raises(ValueError, match="kv_type 'q5_1' is not one of"):
        LlamaCppRunner(default_model, LlamaCppOptions(n_ctx=256, kv_type="q5_1"))
    with pytest.raises(ValueError, match="needs flash_attn=True"):
        LlamaCppRunner(default_model, LlamaCppOptions(n_ctx=256, kv_type="q8_0", flash_attn=False))


# -- torch runner ----------------------------------------------------------------------------------
def torch_allocation(runner: Any) -> tuple[int, float]:
    """(weight bytes, KV bytes per cache slot) of an OpsRunner over TorchOps."""
    weights = sum(t.nbytes for t in runner.weights.values())
    ops = runner.ops
    kv = sum(t.nbytes for t in ops.k_cache) + sum(t.nbytes for t in ops.v_cache)
    return weights, kv / (runner.kv.num_blocks * runner.kv.block_size)


def test_torch_runner_on_the_default_gguf_matches_the_plan(default_model: Path) -> None:
    # 512 tokens: Gemma 3's window. Beyond it the torch runner still allocates sliding layers whole
    # while the planner (pricing a window-aware engine) counts the window.
    torch = pytest.importorskip("torch")
    from twinfer.backends.cuda.runner import load_torch_runner
    from twinfer.runtime.loaders import load_model

    context = 512
    weights, kv = runner_formats("torch", CPU)
    plan = planned(default_model, context, weights, kv)
    assert (plan["engine"], plan["weights_format"], plan["kv_format"]) == ("torch", "f32", "f32")
    runner = load_torch_runner(load_model(default_model), dtype=torch.float32, kv_tokens=context)
    held, per_slot = torch_allocation(runner)
    assert plan["memory"]["weights_bytes"] == pytest.approx(held, rel=TOL)
    assert plan["memory"]["kv_bytes_per_token"] == pytest.approx(per_slot, rel=TOL)
    assert per_slot == 18 * 2 * 1 * 256 * 4  # layers x (K, V) x KV heads x head dim x float32


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mixtral"])
def test_torch_runner_on_a_tiny_hf_model_matches_the_plan(tmp_path: Path, arch: str) -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from fixtures_models import hf_model

    from twinfer.backends.cuda.runner import load_torch_runner
    from twinfer.runtime.loaders import load_model

    hf_model(arch).save_pretrained(tmp_path)  # float32 safetensors
    plan = planned(tmp_path, 64, "auto", "auto")  # a CPU plans the torch runner, as `twinfer plan` would
    assert (plan["engine"], plan["kv_format"]) == ("torch", "f32")
    runner = load_torch_runner(load_model(tmp_path), dtype=torch.float32, kv_tokens=64)
    held, per_slot = torch_allocation(runner)
    assert plan["memory"]["weights_bytes"] == pytest.approx(held, rel=TOL)
    assert plan["memory"]["kv_bytes_per_token"] == pytest.approx(per_slot, rel=TOL)
