"""Verdicts users can trust: an endpoint judged against the kernel floor of the model it serves (faithful,
within kernel noise, degraded), and explicit formats planned where a runner runs them."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from twinfer.planners.catalog import find
from twinfer.planners.hardware import Cluster, lookup
from twinfer.planners.hw_table import DEVICES, NODE_SHAPES
from twinfer.planners.plan import Plan, make_plan
from twinfer.planners.search import Request


def _plan(model: str, hardware: str, fmt: str = "auto", context: int = 4096) -> Plan:
    device, _ = lookup(hardware, DEVICES, NODE_SHAPES)
    return make_plan(find(model).profile(), Cluster(device), Request(context=context, weights_format=fmt))


def test_an_explicit_gguf_format_on_a_datacenter_gpu_runs_on_llama_cpp_with_the_reason() -> None:
    plan = _plan("llama-2-7b", "a30", "q4_0")
    assert plan.target == "datacenter" and plan.fits and plan.strategy is not None
    assert (plan.strategy.mix.name, plan.strategy.engine) == ("q4_0", "llamacpp")
    why = next(r for r in plan.reasons if r.startswith("--format q4_0"))
    assert "not native on NVIDIA A30" in why and "llama.cpp runner" in why
    assert 90 < plan.to_json()["predicted"]["decode_tokens_per_s"] < 130  # the scoreboard's A30: 124.8 at tg128


def test_left_to_choose_the_datacenter_target_still_serves_only_native_formats() -> None:
    plan = _plan("llama-2-7b", "a30")
    assert plan.fits and plan.strategy is not None and plan.strategy.engine != "llamacpp"
    assert not any(r.startswith("--format") for r in plan.reasons)


@pytest.mark.parametrize("hardware", ["rtx-4090", "rtx-3090"])
@pytest.mark.parametrize("fmt", ["mxfp4", "native"])
def test_gpt_oss_as_published_plans_on_the_runner_that_runs_it(hardware: str, fmt: str) -> None:
    plan = _plan("gpt-oss-20b", hardware, fmt)
    assert plan.fits and plan.strategy is not None, plan.suggestion
    assert (plan.strategy.mix.name, plan.strategy.engine) == ("gguf-mxfp4", "llamacpp")
    why = next(r for r in plan.reasons if r.startswith(f"--format {fmt}"))
    assert "MXFP4 experts + BF16" in why and "torch runner does not hold mxfp4" in why
    auto = _plan("gpt-oss-20b", hardware)  # the same file the planner picks unasked, at the same speed
    assert auto.strategy is not None and auto.strategy.mix.name == "gguf-mxfp4"
    assert plan.to_json()["predicted"]["decode_tokens_per_s"] == pytest.approx(
        auto.to_json()["predicted"]["decode_tokens_per_s"])


def test_asking_for_a_models_main_format_means_the_published_mix_not_a_requantization() -> None:
    plan = _plan("gpt-oss-20b", "b200", "mxfp4")  # Blackwell multiplies FP4: the published checkpoint as is
    assert plan.fits and plan.strategy is not None and plan.strategy.mix.name == "mxfp4-moe"


# -- the endpoint verifier against real `twinfer serve` processes at their defaults --------------------

TOKENS = 64


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _twinfer_serve(model: str | None) -> Iterator[str]:
    """`twinfer serve [MODEL] --port P` with nothing else set: the kernels a user's server runs."""
    port = _free_port()
    cmd = [sys.executable, "-m", "twinfer.cli.main", "serve", *([model] if model else []), "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            time.sleep(1)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def default_server() -> Iterator[str]:
    pytest.importorskip("llama_cpp")
    pytest.importorskip("openai")
    with _twinfer_serve(None) as url:
        yield url


def test_eval_kl_against_twinfer_serve_at_defaults_is_within_kernel_noise_with_the_floor_printed(
        default_server: str) -> None:
    cmd = [sys.executable, "-m", "twinfer.cli.main", "eval", "kl", "--reference", "llamacpp", "--candidate",
           default_server, "--corpus", "prose", "--tokens", str(TOKENS)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr
    lines = [line.strip() for line in out.stdout.splitlines()]
    floor = next(line for line in lines if line.startswith("kernel floor"))
    assert f"measured: llama.cpp with weights repacked vs as stored, on these {TOKENS} tokens of prose" in floor
    assert any(line.startswith("reference kernels: llama.cpp, weights as stored; `twinfer serve` repacks")
               for line in lines)
    assert lines[-1].startswith("within kernel noise: mean KL"), out.stdout  # the server repacks, the reference not
    assert not any(line.startswith("FLAGGED") for line in lines)


def test_a_reference_on_the_servers_own_kernels_finds_it_faithful(default_server: str) -> None:
    from twinfer.app.runners import RUNNERS
    from twinfer.quant.allowance import FAITHFUL
    from twinfer.quant.remote import measure_remote_kl

    report = measure_remote_kl(None, "llamacpp:mode=fast", default_server, "prose", TOKENS, runners=RUNNERS)
    assert report.verdict == FAITHFUL and report.kl.mean_kl <= 1e-3, report.lines()
    assert report.kl.top1_agreement == 1.0
    # the floor is the same two kernel paths measured from the other side: of the same size
    assert 1e-3 < report.floor.kl < report.floor.allowance < 0.02, report.floor
    assert report.kernels.startswith("reference kernels: llama.cpp, weights repacked")


def test_a_server_on_a_q2_k_requantization_is_degraded(default_model: Path) -> None:
    pytest.importorskip("llama_cpp")
    from twinfer.app.runners import RUNNERS
    from twinfer.backends.llamacpp.requantize import requantize_gguf
    from twinfer.quant.allowance import DEGRADED
    from twinfer.quant.remote import measure_remote_kl

    q2_k = requantize_gguf(default_model, "q2_k", "MOSTLY_Q2_K")  # llama.cpp's quantizer, as twinfer quantize runs it
    with _twinfer_serve(str(q2_k)) as url:
        report = measure_remote_kl(None, "llamacpp", url, "prose", TOKENS, runners=RUNNERS)
    assert report.verdict == DEGRADED and not report.faithful
    assert report.kl.mean_kl > 10 * report.floor.allowance, (report.kl.mean_kl, report.floor)
    last = report.lines()[-1].strip()
    assert last.startswith("FLAGGED: mean KL") and "degraded: the endpoint does not serve this model" in last
    d = report.as_dict()
    assert d["verdict"] == DEGRADED and d["floor"]["source"].startswith("measured: ") and d["allowance"] > 0


def test_doctor_and_verifier_share_one_allowance() -> None:
    from twinfer.app import doctor_stages
    from twinfer.quant.allowance import LLAMA_CPP_CPU, NOISE, verdict

    assert doctor_stages.LLAMA_CPP.max_kl == LLAMA_CPP_CPU.allowance
    assert verdict(0.0063, LLAMA_CPP_CPU) == NOISE  # doctor's own measured floor passes the verifier too
