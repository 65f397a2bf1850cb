"""The runtime core imports no backend library, and user errors are one line."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import twinfer.runtime

BLOCKED = ("torch", "mlx", "llama_cpp", "triton")


def test_every_runtime_module_imports_with_backends_blocked() -> None:
    names = [m.name for m in pkgutil.walk_packages(twinfer.runtime.__path__, "twinfer.runtime.")]
    assert len(names) > 20, names
    code = (
        "import sys, importlib, json\n"
        f"for b in {BLOCKED!r}: sys.modules[b] = None\n"
        f"names = {names!r}\n"
        "for n in names: importlib.import_module(n)\n"
        f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {BLOCKED!r} and sys.modules[m] is not None)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def _twinfer(*args: str, timeout: int = 120) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "twinfer.cli.main", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def _assert_one_line_error(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("twinfer: error:"), lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_missing_model_path() -> None:
    _assert_one_line_error(_twinfer("generate", "/no/such/model.gguf", "hi"), "/no/such/model.gguf", "does not exist")


def test_truncated_gguf(tmp_path: Path, default_model: Path) -> None:
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(default_model.read_bytes()[:100_000])
    _assert_one_line_error(_twinfer("generate", str(bad), "hi"), "cut.gguf")


def test_directory_without_config(tmp_path: Path) -> None:
    _assert_one_line_error(_twinfer("generate", str(tmp_path), "hi"), "config.json")


def test_unknown_model_type(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no_such_arch", "hidden_size": 8}))
    _assert_one_line_error(_twinfer("generate", str(tmp_path), "hi"), "no_such_arch")


def test_empty_prompt() -> None:
    _assert_one_line_error(_twinfer("generate", "  "), "prompt is empty")


def test_unknown_backend() -> None:
    _assert_one_line_error(_twinfer("generate", "hi", "--backend", "cuda9"), "cuda9")


@pytest.mark.parametrize("args", [["--help"], ["generate", "--help"], ["eval", "kl", "--help"]])
def test_help_is_fast_and_lists_options(args: list[str]) -> None:
    code = (
        f"import sys\nsys.argv = ['twinfer', *{args!r}]\nfrom twinfer.cli.main import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "print('HEAVY', sorted(m for m in ('torch', 'mlx', 'llama_cpp', 'transformers') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "HEAVY []" in out.stdout, out.stdout[-500:]
    assert "Usage" in out.stdout
