"""Shared fixtures: the embedded default model, quiet numerics for CPU tests, and a pinned machine.

Every plan the suite makes sees the same hardware on every machine: the probe reads the host named by
$TWINFER_HOST_FACTS (a description in tests/hosts/), never the machine the tests run on. Pick another
simulated host with TWINFER_TEST_HOST=laptop|server|apple. Caches live under a fresh $TWINFER_CACHE
unless one is given, so no verdict depends on what ran before. Every temporary file of the run, the
servers it starts included, lies in one folder removed when the run ends.
"""

from __future__ import annotations

import atexit
import os
import shutil
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
# converted test models are kept between runs (tests/gguf_convert.py): beside the run's folder, not in it
os.environ.setdefault("TWINFER_TEST_SHARED_CACHE", os.path.join(tempfile.gettempdir(), "twinfer-test-shared"))
_ROOT = tempfile.mkdtemp(prefix="twinfer-tests-")
atexit.register(shutil.rmtree, _ROOT, ignore_errors=True)
tempfile.tempdir = os.environ["TMPDIR"] = _ROOT
os.environ.setdefault("TWINFER_CACHE", tempfile.mkdtemp(prefix="cache-"))


@pytest.fixture(scope="session")
def default_model() -> Path:
    from twinfer.runtime.loaders import default_model_path

    return default_model_path()
