"""The planner's predicted memory for a GGUF MoE under `--memory-budget` against what the OS measures.

The 79 MB random Qwen3-MoE (tests/moe_gguf.py, shape `tiny`) is opened through `open_session` in a child
process on a pinned CPU description, prompted with 64 tokens and decoded 32; the prediction is the plan's
model bytes (weights as loaded, KV, llama.cpp's compute buffer and fixed costs) and the measurement the
process's growth over its baseline (interpreter, libraries, tokenizer):

- requantized to fit (half the file): the peak (VmHWM) within 10% of the prediction;
- experts paged under a bound (30% of the file): the peak at least 90% of the prediction (the floor of
  dense weights, KV and buffers, plus the bound or one layer's experts, whichever is more) and at most the
  prediction plus the kernel's fault-around beside a token's expert slices; what the process holds between
  steps under the prediction.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from budget_child import run_child, tiny_moe_gguf

HOST = "kind=cpu,memory=16GB,bandwidth=20GB/s,vector=0.2TFLOPS,cores=2,storage=3GB/s"

_SCRIPT = """
import json, sys
from twinfer.app import OpenOptions, open_session
from twinfer.backends.llamacpp._lib import load_llama_cpp
from twinfer.planners.describe import resolve_cluster
from twinfer.runtime.batch import SeqChunk, StepBatch
from twinfer.runtime.tokenizer import load_tokenizer
path, budget, host = sys.argv[1:4]
load_llama_cpp(), load_tokenizer(path)  # the baseline holds the libraries and the tokenizer
base = status()
session = open_session(OpenOptions(path, 'llamacpp', max_seqs=1, threads=1, ctx=256, memory_budget=budget,
                                   hardware=resolve_cluster(host)))
runner, table = session.opened.runner, list(range(8))
logits = runner.step(StepBatch([SeqChunk(1, list(range(3, 67)), 0, table)]))
token, pos, held = int(logits[-1].argmax()), 64, []
for _ in range(32):
    logits = runner.step(StepBatch([SeqChunk(1, [token], pos, table)]))
    token, pos = int(logits[-1].argmax()), pos + 1
    held.append(status()['VmRSS'] - base['VmRSS'])
s = session.strategy
print(json.dumps(dict(peak=status()['VmHWM'] - base['VmRSS'], held=max(held), predicted=s.predicted_bytes,
                      paged=s.expert_cache_bytes is not None, bound=s.expert_cache_bytes or 0,
                      requantized=s.requantize)))
"""


@pytest.fixture(scope="module")
def moe_gguf() -> Path:
    return tiny_moe_gguf()


def _measure(model: Path, budget: int, cache: Path) -> dict:
    return run_child(_SCRIPT, str(model), str(budget), HOST, env={"TWINFER_CACHE": str(cache)})


def test_requantized_peak_is_predicted(moe_gguf: Path, tmp_path: Path) -> None:
    m = _measure(moe_gguf, moe_gguf.stat().st_size // 2, tmp_path)
    assert m["requantized"] and not m["paged"]
    assert m["peak"] == pytest.approx(m["predicted"], rel=0.10), m


def test_paged_peak_is_predicted(moe_gguf: Path, tmp_path: Path) -> None:
    m = _measure(moe_gguf, moe_gguf.stat().st_size * 3 // 10, tmp_path)
    assert m["paged"] and not m["requantized"]
    # the load maps the file unread and the pager makes room layer by layer: the peak is the plan's floor
    # plus one layer's experts (a prompt reads them all), not the file. The kernel's fault-around maps up to
    # 16 pages beside each expert slice a token reads, which on this model's 96 KiB slices is a share the
    # plan does not count (on the gpt-oss shape's 4.4 MB slices it is none: docs/benchmarks.md)
    fault_around = 8 * 4 * 3 * 2 * 64 * 1024  # layers x top-4 x (gate, up, down) x both sides
    assert 0.9 * m["predicted"] <= m["peak"] <= m["predicted"] + fault_around, m
    assert m["held"] <= m["predicted"] + fault_around, m
    assert m["peak"] < 0.5 * moe_gguf.stat().st_size, m
