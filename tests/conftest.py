"""Shared fixtures: the embedded default model, quiet numerics for CPU tests, and a pinned machine.

Every plan the suite makes sees the same hardware on every machine: the probe reads the host named by
$TWINFER_HOST_FACTS (a description in tests/hosts/), never the machine the tests run on. Pick another
simulated host with TWINFER_TEST_HOST=laptop|server|apple. Caches live under a fresh $TWINFER_CACHE
unless one is given, so no verdict depends on what ran before.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

HOSTS = {
    "laptop": "laptop-avx2-2c.json",  # 2 cores, AVX2, 16 GB
    "server": "server-avx512-16c.json",  # 16 cores, AVX-512 VNNI, 128 GB
    "apple": "apple-m2-max.json",  # M2 Max, 38-core GPU, 64 GB
}
HOST_DIR = Path(__file__).parent / "hosts"

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ["TWINFER_HOST_FACTS"] = str(HOST_DIR / HOSTS[os.environ.get("TWINFER_TEST_HOST", "laptop")])
os.environ.setdefault("TWINFER_CACHE", tempfile.mkdtemp(prefix="twinfer-test-cache-"))


@pytest.fixture(scope="session")
def default_model() -> Path:
    from twinfer.runtime.loaders import default_model_path

    return default_model_path()
