"""bench/gpu_moe.py, the DeepSeek-V3-shaped MoE case of bench/gpu_check.sh: its dry run on CPU at a tiny
width computes what the GPU run would (EP rank, FP8 projections), and its byte accounting adds up."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path
from types import ModuleType

import pytest

pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parents[1]


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_moe", ROOT / "bench" / "gpu_moe.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dry_run_rows_and_bytes() -> None:
    bench = _bench()
    info = bench.run(bench.parse(["--dry-run", "--batches", "1,4", "--ep", "4", "--layers", "2"]))
    spec = bench.deepseek_v3(2, tiny=True)
    rows = info["rows"]
    assert [(r["format"], r["ep"], r["batch"]) for r in rows] == [("fp8", 4, 1), ("fp8", 4, 4)]
    per_expert = 3 * spec.moe.expert_intermediate_size * spec.hidden_size * 4  # float32 on CPU
    one = rows[0]
    # batch 1: top_k / EP of a token's experts live on this rank, in each of the two layers
    assert one["expert_bytes_read"] == pytest.approx(2 * per_expert * spec.moe.top_k / 4)
    for r in rows:
        assert r["bytes_per_step"] == pytest.approx(r["dense_bytes"] + r["expert_bytes_read"] + r["kv_bytes"])
        assert r["tokens_per_s"] > 0 and r["achieved_tbps"] > 0
    assert rows[1]["expert_bytes_read"] > one["expert_bytes_read"]


def test_ep_rank_computes_its_share_of_the_resident_moe() -> None:
    """Summed over the EP ranks, the ranks' expert outputs are the one-device MoE's (float32, CPU)."""
    import torch

    bench = _bench()
    spec = bench.deepseek_v3(1, tiny=True)
    moe = spec.moe
    g = torch.Generator().manual_seed(0)
    E, Ie, C = moe.num_experts, moe.expert_intermediate_size, spec.hidden_size
    x = torch.randn(5, C, generator=g)
    router = torch.randn(E, C, generator=g)
    gate, up, down = torch.randn(E, Ie, C, generator=g), torch.randn(E, Ie, C, generator=g), torch.randn(E, C, Ie, generator=g)
    extras = bench.ExpertExtras(score_bias=torch.randn(E, generator=g) * 0.1)
    full = bench.TorchOps(spec, num_blocks=1, block_size=16, kernels="torch").moe(x, router, gate, up, down, moe, "silu", extras)
    ep, local = 4, E // 4
    parts = [bench.EPRankOps(spec, first=r * local, num_blocks=1, block_size=16, kernels="torch").moe(
        x, router, gate[r * local:(r + 1) * local], up[r * local:(r + 1) * local], down[r * local:(r + 1) * local],
        moe, "silu", extras) for r in range(ep)]
    assert torch.allclose(sum(parts), full, atol=1e-4)


def test_gpu_check_runs_the_moe_case() -> None:
    script = (ROOT / "bench" / "gpu_check.sh").read_text()
    assert "bench/gpu_moe.py --layers 4 --ep 8 --batches 1,64 --formats fp8" in script
    assert "bench/gpu_moe.py --dry-run" in script
    assert subprocess.run(["bash", "-n", str(ROOT / "bench" / "gpu_check.sh")]).returncode == 0
