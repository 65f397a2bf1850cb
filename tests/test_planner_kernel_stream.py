"""CPU decode streams its weights at the slower of DRAM and llama.cpp's kernels: a pinned 2-core AVX-512
host whose DRAM outruns the plain (non-repacked) dot products gets no faster decode from more bandwidth,
while a repacked format keeps following the bandwidth; GPUs and cores-unknown devices have no such bound."""

from __future__ import annotations

from dataclasses import replace

import pytest

from twinfer.planners import probe
from twinfer.planners.calibration import DEFAULTS
from twinfer.planners.cost import _kernel_stream_s, on_huge_pages
from twinfer.planners.formats import COMPONENTS
from twinfer.planners.hw_table import DEVICES
from twinfer.planners.plan import make_plan
from twinfer.planners.search import Request
from twinfer.planners.source import resolve

_AVX512 = frozenset({"avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"})


def _host(gbs: float, flags: frozenset[str] = _AVX512, machine: str = "x86_64", huge: bool = False) -> probe.HostFacts:
    return probe.HostFacts(system="Linux", machine=machine, model="pinned", vendor="AuthenticAMD", flags=flags,
                           cpus=2, cores=2, ghz=2.6, memory_bytes=24e9, measured_gbs=gbs, measured_gflops=200.0,
                           huge_pages=huge)


def _decode(gbs: float, huge: bool = False) -> float:
    plan = make_plan(resolve(None), probe.probe_cpu(_host(gbs, huge=huge)), Request(64, 1))
    return float(plan.to_json()["predicted"]["decode_tokens_per_s"])


def test_repacked_formats_follow_the_isa() -> None:
    x86 = probe.llamacpp_repacks(_host(20))
    assert {"q4_0", "q4_k", "iq4_nl", "q2_k"} <= set(x86) and "q8_0" not in x86 and "q5_0" not in x86
    avx2 = probe.llamacpp_repacks(_host(20, frozenset({"avx", "avx2", "fma"})))
    assert "q4_k" in avx2 and "q2_k" not in avx2  # Q2_K's tiles need AVX-512
    arm = probe.llamacpp_repacks(_host(20, frozenset({"asimd", "asimddp"}), machine="aarch64"))
    assert {"q8_0", "q6_k", "q5_k"} <= set(arm)
    assert probe.llamacpp_repacks(_host(20, frozenset({"sse4_2"}))) == ()


def test_decode_stops_following_dram_at_the_kernels_rate() -> None:
    slow, fast, faster = _decode(10.0), _decode(34.0), _decode(60.0)
    assert slow < fast * 0.8  # at 10 GB/s the DRAM sets the pace
    assert faster == pytest.approx(fast, rel=0.01)  # past the kernels' rate more DRAM buys nothing (the KV read still does)


def test_the_kernels_read_repacked_formats_faster_and_only_on_cpus() -> None:
    profile = resolve(None)
    device = probe.probe_cpu(_host(30)).device
    eff = DEFAULTS["llamacpp/cpu"]
    mix = profile.stored
    assert mix is not None
    plain = _kernel_stream_s(profile, replace(device, repacks=()), eff, mix, 0.0)
    everything = tuple({f for c in COMPONENTS for f, _ in profile.split(mix, c)})
    repacked = _kernel_stream_s(profile, replace(device, repacks=everything), eff, mix, 0.0)
    assert repacked == pytest.approx(plain * eff.stream_plain / eff.stream_repacked, rel=0.05)
    # about 3 bytes a cycle a core: the default model's ~235 MB at 2 cores x 3.1 GHz take about 12 ms
    assert 0.008 < plain < 0.016
    assert _kernel_stream_s(profile, replace(device, cores=0), eff, mix, 0.0) == 0.0
    gpu = DEVICES["h100-sxm"]
    assert _kernel_stream_s(profile, gpu, eff, mix, 0.0) == 0.0


def test_weights_on_huge_pages_stream_faster_unless_the_model_stays_mapped() -> None:
    """The runner puts weights on huge pages where the kernel gives them and the model is at most half the
    memory (backends/llamacpp/hugepages.py): decode then streams faster, from DRAM or through the kernels,
    by the calibrated factor on the streaming part of the step; a host without THP, or one the model
    fills past half, plans as before."""
    factor = DEFAULTS["llamacpp/cpu"].huge_pages
    assert factor > 1
    for gbs in (10.0, 34.0):  # DRAM-bound, then kernel-bound
        small, huge = _decode(gbs), _decode(gbs, huge=True)
        assert small * 1.05 < huge < small * factor  # fixed per-step costs do not speed up
    profile, device = resolve(None), probe.probe_cpu(_host(34.0, huge=True)).device
    mix = profile.stored
    assert mix is not None and on_huge_pages(profile, device, mix)
    assert not on_huge_pages(profile, replace(device, memory_gb=0.4), mix)  # 235 MB: over half of 400 MB
    assert not on_huge_pages(profile, replace(device, huge_pages=False), mix)
    assert not on_huge_pages(profile, replace(DEVICES["h100-sxm"], huge_pages=True), mix)  # a GPU's own memory
