"""The simulated machines tests plan for (tests/hosts/*.json), never the machine the tests run on."""

from __future__ import annotations

from pathlib import Path

from twinfer.planners.hardware import Cluster
from twinfer.planners.probe import HostFacts, probe_cpu

HOSTS = Path(__file__).parent / "hosts"
LAPTOP = HOSTS / "laptop-avx2-2c.json"  # 2 cores, AVX2, 16 GB, 18 GB/s measured


def pinned_cpu(path: Path = LAPTOP) -> Cluster:
    """The CPU cluster of a simulated host (the 2-core AVX2 laptop unless named)."""
    return probe_cpu(HostFacts.from_json(str(path)))
