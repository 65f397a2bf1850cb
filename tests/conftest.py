"""Shared fixtures: the embedded default model, and quiet numerics for CPU tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def default_model() -> Path:
    from twinfer.runtime.loaders import default_model_path

    return default_model_path()
