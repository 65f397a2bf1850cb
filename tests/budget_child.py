"""What the memory-budget tests share: the tiny MoE GGUF they page, and a child process that reports its
own memory from /proc/self/status (so a reading is the model's alone, not the test runner's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from gguf_convert import _cache_root

ROOT = Path(__file__).resolve().parents[1]

# a child script starts with this; status() reads the kernel's figures in bytes
STATUS = """
def status():
    out = {}
    for line in open('/proc/self/status'):
        key, _, value = line.partition(':')
        if key in ('VmHWM', 'VmRSS', 'RssAnon', 'RssFile'):
            out[key] = int(value.split()[0]) * 1024
    return out
"""


def tiny_moe_gguf(routing: str = "random", needs: str = "/proc/self/status") -> Path:
    """The ~79 MB random Qwen3-MoE, converted once and kept between runs; skips without llama.cpp,
    transformers or the /proc file the test reads."""
    pytest.importorskip("llama_cpp")
    pytest.importorskip("transformers")
    if not Path(needs).exists():
        pytest.skip(f"needs {needs} to measure a process's memory")
    from moe_gguf import write_qwen3_moe_gguf

    folder = _cache_root() / "budget-gguf"
    folder.mkdir(parents=True, exist_ok=True)
    return write_qwen3_moe_gguf(folder, "tiny", routing=routing)


def run_child(script: str, *args: str, env: dict[str, str] | None = None) -> dict:
    """Run `script` (STATUS first) in a fresh interpreter; its last line of output, as JSON."""
    result = subprocess.run([sys.executable, "-c", STATUS + script, *args], capture_output=True, text=True,
                            timeout=600, cwd=ROOT, env={**os.environ, **(env or {})})
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])
