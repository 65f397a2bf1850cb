"""A missing optional package is one line naming it and the extra that brings it, never a traceback."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from twinfer.runtime.errors import MissingPackage, require


def test_require_names_the_package_and_its_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "accelerate", None)  # import accelerate now raises ImportError
    with pytest.raises(MissingPackage, match=r"needs the accelerate package.*pip install 'twinfer\[reference\]'"):
        require("the transformers reference", "json", "accelerate")
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    with pytest.raises(MissingPackage, match="pip install llama-cpp-python$"):
        require("the llama.cpp runner", "llama_cpp")


def test_eval_kl_without_accelerate_is_one_line(tmp_path) -> None:
    script = textwrap.dedent("""
        import sys
        sys.modules["accelerate"] = None
        sys.argv = ["twinfer", "eval", "kl", "--reference", "transformers", "--candidate", "llamacpp", "--tokens", "8"]
        from twinfer.cli.main import main
        main()
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                       env={"TWINFER_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        "twinfer: error: the transformers reference needs the accelerate package, which is not installed: "
        "pip install 'twinfer[reference]'"]
