"""Native formats on the datacenter target: the refusal, the FP8 linear, the planner's choices, gpu_check.

FP8 runs through `torch._scaled_mm` on a GPU (the cuda-marked test) and through the same arithmetic
in float32 elsewhere; the planner's H200/B200 plans may name only formats those GPUs multiply natively.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from twinfer.backends.cuda.formats import (  # noqa: E402
    FormatRefused,
    Fp8Linear,
    check_format,
    fp8_linear_reference,
    native_formats,
    native_weight_format,
    quantize_rows,
)

ROOT = Path(__file__).resolve().parents[1]
HOPPER, BLACKWELL, AMPERE = (9, 0), (10, 0), (8, 0)


@pytest.mark.parametrize(
    ("fmt", "cap", "message"),
    [("q4_k", HOPPER, "GGUF k-quants are expanded by a dequantization loop"),
     ("int4", BLACKWELL, "integer weight-only formats are expanded by a dequantization loop"),
     ("tq4", HOPPER, "TurboQuant codebooks"),
     ("nvfp4", HOPPER, "Hopper has no FP4 tensor cores"),
     ("mxfp4", HOPPER, "quantize to fp8 or serve bf16"),
     ("fp8", AMPERE, "Ampere has no FP8 tensor cores"),
     ("q5_x", HOPPER, "unknown weight format")],
)  # fmt: skip
def test_dequantizing_formats_are_refused_with_the_reason(fmt: str, cap: tuple[int, int], message: str) -> None:
    with pytest.raises(FormatRefused, match=message) as err:
        check_format(fmt, cap)
    assert "\n" not in str(err.value)


def test_native_formats_per_generation() -> None:
    assert native_formats(BLACKWELL) == ("nvfp4", "mxfp4", "fp8", "bf16")
    assert native_formats(HOPPER) == native_formats((8, 9)) == ("fp8", "bf16")
    assert native_formats(AMPERE) == ("bf16",)
    assert [check_format(f, BLACKWELL) for f in ("NVFP4", "fp8")] == ["nvfp4", "fp8"]
    with pytest.raises(FormatRefused, match="bf16, f32 or fp8"):
        native_weight_format("q4_k", torch.device("cpu"))


def test_fp8_linear_matches_its_definition_and_stays_near_float() -> None:
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(7, 64, generator=g), torch.randn(48, 64, generator=g) * 0.125
    lin = Fp8Linear.from_weight(w)
    assert lin.codes.dtype == torch.float8_e4m3fn and lin.scale.shape == (48, 1)
    xq, xs = quantize_rows(x)
    want = (xq.float() * xs) @ (lin.codes.float() * lin.scale).t()
    assert (lin(x) - want).abs().max() <= 1e-5
    exact = x @ w.t()
    assert (lin(x) - exact).abs().max() <= 0.08 * exact.abs().max()  # E4M3 keeps 3 mantissa bits


def test_fp8_runner_keeps_greedy_tokens() -> None:
    from twinfer.backends.cuda.runner import build_torch_runner
    from twinfer.runtime.batch import LogitsWanted, SeqChunk, StepBatch
    from twinfer.runtime.spec import ModelSpec

    spec = ModelSpec("llama", 64, 64, 2, 4, 2, 16, 96)
    rng = np.random.default_rng(0)
    shapes = {"embed": (64, 64), "norm": (64,), "lm_head": (64, 64)}
    for i in range(2):
        shapes |= {f"layers.{i}.{n}": s for n, s in [("attn_norm", (64,)), ("mlp_norm", (64,)), ("q", (64, 64)),
                   ("k", (32, 64)), ("v", (32, 64)), ("o", (64, 64)), ("gate", (96, 64)), ("up", (96, 64)),
                   ("down", (64, 96))]}  # fmt: skip
    weights = {n: (rng.normal(size=s) * (s[-1] ** -0.5 if len(s) == 2 else 1) + (len(s) == 1)).astype(np.float32)
               for n, s in shapes.items()}
    weights["embed"] *= 8
    batch = StepBatch([SeqChunk(0, [1, 5, 9, 33, 2], 0, [0, 1], LogitsWanted.ALL)])
    full = build_torch_runner(spec, weights, kv_tokens=32, block_size=4).step(batch)
    fp8 = build_torch_runner(spec, weights, kv_tokens=32, block_size=4, weight_format="fp8").step(batch)
    assert np.abs(fp8 - full).max() <= 0.1 * np.abs(full).max()
    assert np.abs(fp8 - full).max() > 0  # the FP8 path really ran
    assert (fp8.argmax(-1) == full.argmax(-1)).mean() >= 0.8


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_scaled_mm_matches_reference_on_gpu() -> None:
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 tensor cores need compute capability 8.9+")
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(32, 256, generator=g, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(128, 256, generator=g, device="cuda", dtype=torch.bfloat16) * 0.0625
    lin = Fp8Linear.from_weight(w)
    xq, xs = quantize_rows(x)
    want = fp8_linear_reference(xq, xs, lin.codes, lin.scale)
    assert (lin(x).float() - want).abs().max() <= 0.02 * want.abs().max()  # bf16 output rounding


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_decode_rows_take_the_fp8_weight_kernel_on_gpu() -> None:
    """At most 16 rows: the codes widened in registers against 16-bit activations, the scale at the end."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 tensor cores need compute capability 8.9+")
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(4096 + 32, 1024, generator=g, device="cuda", dtype=torch.bfloat16) * 0.03
    lin = Fp8Linear.from_weight(w)
    for rows in (1, 3, 16, 64):  # 64: past the default max_rows, through the kernel itself
        x = torch.randn(rows, 1024, generator=g, device="cuda", dtype=torch.bfloat16)
        if rows > 16:
            from twinfer.backends.cuda.kernels.fp8_gemm import fp8_weight_gemm

            got = fp8_weight_gemm(x, lin.codes, lin.scale)
            assert (got.float() - x.float() @ lin.dequantize().t()).abs().max() <= 0.01 * got.float().abs().max()
            continue
        want = x.float() @ lin.dequantize().t()
        assert (lin(x).float() - want).abs().max() <= 0.01 * want.abs().max()  # bf16 output rounding


def _plan(model: str, hardware: str) -> dict[str, object]:
    from typer.testing import CliRunner

    from twinfer.cli.main import app

    result = CliRunner().invoke(app, ["plan", model, "--hardware", hardware, "--json"])
    assert result.exit_code == 0, result.output
    plan: dict[str, object] = json.loads(result.output)
    return plan


PLANS = [(m, h, cap) for m in ("llama-3.1-8b", "llama-3.1-70b", "qwen3-30b-a3b", "gpt-oss-120b")
         for h, cap in (("h200", HOPPER), ("b200", BLACKWELL))]  # fmt: skip


def _plan_any(model: str, hardware: str, *extra: str) -> dict[str, object]:
    from typer.testing import CliRunner

    from twinfer.cli.main import app

    result = CliRunner().invoke(app, ["plan", model, "--hardware", hardware, "--json", *extra])
    plan: dict[str, object] = json.loads(result.output)
    return plan


@pytest.mark.parametrize(("model", "hardware", "cap"), PLANS)
def test_datacenter_plans_name_only_native_formats(model: str, hardware: str, cap: tuple[int, int]) -> None:
    """Every datacenter plan, on one GPU or (when one is too small) the GPU count the planner asks for."""
    from twinfer.planners.formats import MIXES

    plan = _plan_any(model, hardware)
    if not plan["fits"]:  # e.g. gpt-oss-120b on one H200: MXFP4 experts would fit, but Hopper dequantizes them
        suggestion = str(plan["suggestion"])
        assert suggestion.startswith("use --gpus "), suggestion
        plan = _plan_any(model, hardware, "--gpus", suggestion.split()[2].rstrip(":"))
    assert plan["target"] == "datacenter" and plan["fits"] is True
    native = set(native_formats(cap)) | {"f32"}
    assert MIXES[str(plan["weights_format"])].formats() <= native, plan["weights_format"]
    assert plan["kv_format"] in native


def test_gpu_check_script_parses_and_its_decode_bench_dry_runs() -> None:
    assert subprocess.run(["bash", "-n", str(ROOT / "bench" / "gpu_check.sh")]).returncode == 0
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_decode.py"), "--dry-run", "--json"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    rows = {(r["format"], r["batch"]): r for r in out["rows"]}
    assert set(rows) == {("bf16", 1), ("bf16", 64), ("fp8", 1), ("fp8", 64)}
    # FP8 stores the projections in one byte: its step reads less than the float32 dry-run weights
    assert rows[("fp8", 1)]["bytes_per_step"] < rows[("bf16", 1)]["bytes_per_step"]
    assert all(r["tokens_per_s"] > 0 and r["hbm_fraction"] > 0 for r in rows.values())


def test_gpu_profile_dry_run_reports_each_case() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_profile.py"), "--dry-run", "--cases",
                           "llama:bf16:1,moe:fp8:4", "--top", "3"], capture_output=True, text=True, cwd=ROOT,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    heads = [line for line in proc.stdout.splitlines() if line.startswith("== ")]
    assert [h.split()[1] for h in heads] == ["llama:bf16:1", "moe:fp8:4"]
    assert proc.stdout.count(" ms of it") == 2  # the eager step's kernel time against its wall time


def test_gpu_tune_dry_run_sweeps_each_kernel_and_measures_with_the_winners() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_tune.py"), "--dry-run", "--apply"],
                          capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    heads = [line.split(":")[0] for line in proc.stdout.splitlines() if line.startswith("== ")]
    assert heads == ["== fp8", "== attention", "== moe", "== decode with the winners"]
    assert proc.stdout.count(" default ") == 3  # each table shows the module's current CONFIG first
