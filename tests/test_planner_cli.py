"""`twinfer plan` and `twinfer hw` as a user runs them: JSON shape, one-line errors, fast light startup."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Run the CLI in a fresh interpreter and report which heavy modules it imported.
_PROBE = """
import contextlib, io, json, sys
sys.argv = ["twinfer", *json.loads(sys.argv[1])]
from twinfer.cli.main import main
out = io.StringIO()
code = 0
try:
    with contextlib.redirect_stdout(out):
        main()
except SystemExit as e:
    code = e.code or 0
heavy = [m for m in ("torch", "mlx", "numpy", "llama_cpp", "transformers") if m in sys.modules]
sys.stdout.write(json.dumps({"code": code, "out": out.getvalue(), "heavy": heavy}))
"""


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def twinfer(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "twinfer.cli.main", *args], capture_output=True, text=True,
                          cwd=ROOT, env=_env(), timeout=120)


def probe(*args: str) -> dict[str, object]:
    """The CLI's exit code, output and the heavy modules it imported, from a fresh interpreter."""
    proc = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(list(args))], capture_output=True, text=True,
                          cwd=ROOT, env=_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    return dict(json.loads(proc.stdout))


def test_plan_json_has_the_documented_fields() -> None:
    result = probe("plan", "llama-3.1-70b", "--hardware", "h100", "--gpus", "4", "--concurrency", "16", "--json")
    assert result["code"] == 0
    plan = json.loads(str(result["out"]))
    for key in ("fits", "target", "weights_format", "kv_format", "parallelism", "memory", "predicted", "reasons"):
        assert key in plan
    assert set(plan["parallelism"]) >= {"tp", "ep", "pp"}
    assert set(plan["memory"]) >= {"weights_bytes", "kv_bytes_per_token", "total_bytes", "capacity_bytes"}
    assert set(plan["predicted"]) >= {"decode_tokens_per_s", "decode_tokens_per_s_at_concurrency", "ttft_s"}
    assert plan["fits"] is True and plan["target"] == "datacenter"
    assert plan["memory"]["kv_bytes_per_token"] in (80 * 8 * 128 * 2 * 2, 80 * 8 * 128 * 2 * 1)  # bf16 or fp8
    assert plan["predicted"]["decode_tokens_per_s_at_concurrency"] > plan["predicted"]["decode_tokens_per_s"]
    assert result["heavy"] == []  # start-up is judged by what it imports, not by seconds


def test_hw_list_json_has_the_documented_fields_and_starts_fast() -> None:
    result = probe("hw", "--list", "--json")
    rows = json.loads(str(result["out"]))
    names = {r["name"] for r in rows}
    for name in ("a100-sxm", "h100-sxm", "h100-pcie", "h200", "b200", "b300", "gb200", "gb300", "l40s", "rtx-4090",
                 "rtx-5090", "mi300x", "mi325x", "mi355x", "hgx-h100", "gb200-nvl72", "m1-8c", "m4-max-40c"):
        assert name in names
    for r in rows:
        for key in ("name", "vendor", "chip", "gpu_cores", "memory_gb", "bandwidth_gbs", "interconnect_gbs", "source"):
            assert key in r, (r["name"], key)
        assert r["source"]
    assert result["heavy"] == []  # start-up is judged by what it imports, not by seconds


def test_hw_shows_this_machine() -> None:
    proc = twinfer("hw", "--json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["memory_gb"] > 0 and info["bandwidth_gbs"] > 0


def test_plan_default_model_reads_the_gguf_header_only() -> None:
    laptop = "cpu:memory=16GB,bandwidth=18GB/s,vector=0.15TFLOPS"  # a pinned 2-core laptop, not this machine
    result = probe("plan", "--hardware", laptop, "--json")
    plan = json.loads(str(result["out"]))
    assert plan["fits"] and plan["weights_format"] == "stored" and plan["engine"] == "llamacpp"
    assert "torch" not in result["heavy"] and "llama_cpp" not in result["heavy"]


def test_parametric_model_from_the_command_line() -> None:
    proc = twinfer("plan", "--params", "2.8T", "--active-params", "60B", "--hardware", "gb300", "--gpus", "8",
                   "--format", "nvfp4", "--json")
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["fits"] and 1.4e12 <= plan["memory"]["weights_bytes"] <= 1.6e12


@pytest.mark.parametrize(
    "args,expect",
    [
        (["plan", "llama-3.1-8bb"], "llama-3.1-8b"),
        (["plan", "deepsek-v3"], "deepseek-v3"),
        (["plan", "llama-3.1-8b", "--hardware", "h10"], "unknown hardware"),
        (["plan", "llama-3.1-8b", "--hardware", "h100", "--gpus", "16"], "--nodes 2"),
        (["plan", "llama-3.1-8b", "--hardware", "h100", "--gpus", "0"], "at least 1"),
        (["plan", "llama-3.1-8b", "--hardware", "m2-max-38c", "--gpus", "2"], "single apple device"),
        (["plan", "llama-3.1-8b", "--hardware", "m2-max-38c@48"], "32, 64, 96"),
        (["plan", "llama-3.1-8b", "--context", "10000000"], "limit"),
        (["plan", "llama-3.1-8b", "--concurrency", "0"], "--concurrency"),
        (["plan", "llama-3.1-8b", "--format", "q9_k"], "unknown weight format"),
        (["plan", "--params", "2.8T", "--active-params", "3T"], "--active-params"),
        (["plan", "--params", "lots"], "cannot read"),
        (["plan", "llama-3.1-8b", "--memory-budget", "12XB"], "unknown unit"),
        (["plan", "./no/such/model.gguf"], "does not exist"),
    ],
)
def test_bad_input_is_one_line_without_traceback(args: list[str], expect: str) -> None:
    proc = twinfer(*args)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("twinfer: error:"), proc.stderr
    assert expect.lower() in lines[0].lower()


def test_a_plan_that_does_not_fit_exits_non_zero_with_the_smallest_change() -> None:
    proc = twinfer("plan", "deepseek-v3", "--hardware", "hgx-h100", "--format", "fp8")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "fits      NO" in proc.stdout and "--nodes 2" in proc.stdout
