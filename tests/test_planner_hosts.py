"""The probe takes its machine as data: thread defaults from the CPU topology, peaks from ISA flags, and
the planner, budget and CLI tests giving one verdict under three simulated hosts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from twinfer.planners import probe
from twinfer.runtime.cpu import physical_cores

HOSTS = Path(__file__).parent / "hosts"
ROOT = Path(__file__).parent.parent


def _topology(root: Path, cores: list[tuple[int, int]]) -> Path:
    """A fake /sys/devices/system/cpu: logical CPU i sits on (package, core) cores[i]."""
    for cpu, (package, core) in enumerate(cores):
        topo = root / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "physical_package_id").write_text(f"{package}\n")
        (topo / "core_id").write_text(f"{core}\n")
    return root


def test_threads_follow_physical_cores_not_half_the_cpus(tmp_path: Path) -> None:
    no_smt = _topology(tmp_path / "a", [(0, 0), (0, 1)])  # 2 cores, one thread each (the CI machine)
    smt = _topology(tmp_path / "b", [(0, 0), (0, 1), (0, 0), (0, 1)])  # 2 cores, 2 hyperthreads each
    two_sockets = _topology(tmp_path / "c", [(0, 0), (1, 0)])  # core 0 of each of two packages
    assert physical_cores([0, 1], no_smt) == 2
    assert physical_cores([0, 1, 2, 3], smt) == 2
    assert physical_cores([0, 2], smt) == 1  # an affinity mask holding the two threads of one core
    assert physical_cores([0, 1], two_sockets) == 2
    assert physical_cores([0, 1], tmp_path / "missing") == 2  # unreadable topology: count what we may use


@pytest.mark.parametrize("name,isa,cores,int8_per_f32", [
    ("laptop-avx2-2c.json", "avx2", 2, 2.0),
    ("server-avx512-16c.json", "avx512+vnni+bf16", 16, 4.0),
    ("apple-m2-max.json", "neon+i8mm", 8, 8.0),
])
def test_simulated_cpus_get_their_isa_peaks(name: str, isa: str, cores: int, int8_per_f32: float) -> None:
    host = probe.HostFacts.from_json(str(HOSTS / name))
    device = probe.probe_cpu(host).device
    assert device.label.endswith(f"({cores} cores, {isa})")
    assert device.tflops("int8") == pytest.approx(device.tflops("f32") * int8_per_f32)
    assert device.measured and device.bandwidth_gbs == host.measured_gbs


def test_a_host_without_a_measurement_says_the_bandwidth_is_a_guess() -> None:
    host = probe.HostFacts.from_json(str(HOSTS / "laptop-avx2-2c.json"))
    cluster = probe.probe_cpu(probe.HostFacts(**{**host.__dict__, "measured_gbs": None}))
    assert cluster.device.bandwidth_gbs == 16.0 and not cluster.device.measured
    assert "estimate" in cluster.notes[0]


def test_pinned_apple_host_is_detected_as_its_table_row(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(probe.HOST_ENV, str(HOSTS / "apple-m2-max.json"))
    cluster = probe.detect()
    assert cluster.device.name == "m2-max-38c" and cluster.device.memory_gb == 64


def test_a_bad_host_file_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bad = tmp_path / "host.json"
    bad.write_text('{"system": "Linux"}')
    monkeypatch.setenv(probe.HOST_ENV, str(bad))
    with pytest.raises(probe.PlanError, match="TWINFER_HOST_FACTS"):
        probe.read_host()


def test_measured_bandwidth_is_cached_under_twinfer_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TWINFER_CACHE", str(tmp_path))
    assert probe.cache_file().is_relative_to(tmp_path)
    monkeypatch.setenv(probe.HOST_ENV, str(HOSTS / "laptop-avx2-2c.json"))
    probe._store(probe.read_host().key, 42.0)
    assert probe._cached()[probe.read_host().key] == 42.0



def test_a_measured_gemm_above_the_reported_peak_sets_the_clock() -> None:
    """The 2-core AVX-512 EPYC that reports 2.6 GHz multiplied at 201 GFLOP/s: priced at 3.14 GHz, which
    shortens its prompts; a GEMM below the reported peak (BLAS under peak, a busy moment) keeps 2.6."""
    from twinfer.planners.plan import make_plan
    from twinfer.planners.search import Request
    from twinfer.planners.source import resolve

    base = probe.HostFacts(system="Linux", machine="x86_64", model="epyc", vendor="AuthenticAMD",
                           flags=frozenset({"avx2", "fma", "avx512f", "avx512_vnni"}), cpus=2, cores=2, ghz=2.6,
                           memory_bytes=24e9, measured_gbs=24.7)
    fast, slow = (probe.HostFacts(**{**base.__dict__, "measured_gflops": g}) for g in (201.0, 107.0))
    assert probe.probe_cpu(fast).device.clock_ghz == pytest.approx(201 / 64)
    assert "clock 3.14 GHz from a measured f32 GEMM" in probe.probe_cpu(fast).device.source
    assert probe.probe_cpu(slow).device.clock_ghz == probe.probe_cpu(base).device.clock_ghz == 2.6
    ttft = {name: make_plan(resolve(None), probe.probe_cpu(h), Request(4096, 1)).to_json()["predicted"]["ttft_s"]
            for name, h in (("base", base), ("fast", fast), ("slow", slow))}
    assert ttft["fast"] < 0.9 * ttft["base"] and ttft["slow"] == ttft["base"]


def test_measured_gemm_is_cached_beside_the_bandwidth(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TWINFER_CACHE", str(tmp_path))
    monkeypatch.setenv(probe.HOST_ENV, str(HOSTS / "laptop-avx2-2c.json"))
    key = probe.read_host().key
    rate = probe.measure_cpu_gemm(n=128, seconds=0.01)
    assert rate > 0 and probe._cached()[key + ":gemm"] == round(rate, 1)


# The planner, budget-planning and CLI tests, each under the two simulated hosts the rest of the suite
# does not use (the suite itself runs on the laptop), in a child pytest.
HOST_SENSITIVE = [
    "tests/test_planner_cli.py",
    "tests/test_planner_memory.py",
    "tests/test_planner_seeds.py",
    "tests/test_planner_requant.py",
    "tests/test_budget.py::test_parse_budget",
    "tests/test_budget.py::test_moe_strategies_by_budget",
    "tests/test_requant_embedding.py::test_budget_strategy_requantizes_the_embedding",
    "tests/test_planner_engine.py::test_llamacpp_runner_allocates_the_kv_format_the_planner_chooses",
]


@pytest.mark.parametrize("host", ["server", "apple"])
def test_planner_budget_and_cli_tests_pass_on_other_hosts(host: str, tmp_path: Path) -> None:
    env = {**os.environ, "TWINFER_TEST_HOST": host, "TWINFER_CACHE": str(tmp_path)}
    env.pop("TWINFER_HOST_FACTS", None)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *HOST_SENSITIVE],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_nothing_fits_names_the_budget_that_would(default_model: Path) -> None:
    """The smallest change first: on a machine with memory to spare, the budget, not other hardware."""
    from dataclasses import replace

    from pinned_host import pinned_cpu

    from twinfer.planners.plan import make_plan
    from twinfer.planners.search import Request
    from twinfer.planners.source import resolve

    plan = make_plan(resolve(str(default_model)), replace(pinned_cpu(), memory_budget_bytes=300e6), Request(1024, 1))
    assert not plan.fits
    assert "raise --memory-budget to 3" in plan.suggestion and "--hardware" not in plan.suggestion
    need = int(plan.suggestion.split("raise --memory-budget to ")[1].split()[0])
    roomy = make_plan(resolve(str(default_model)), replace(pinned_cpu(), memory_budget_bytes=need * 1e6),
                      Request(1024, 1))
    assert roomy.fits  # the named budget is enough
