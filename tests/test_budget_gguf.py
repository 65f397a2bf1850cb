"""`--memory-budget` on a GGUF MoE bigger than the budget holds, measured from the OS.

A random Qwen3-MoE (8 layers, 32 experts top-4, BF16, 79 MB) from llama.cpp's own converter, opened in a
child process so its /proc/self/status is the model's alone:

- under a budget of half its bytes, through `open_session` (what generate, chat, serve and bench call),
  the process grows by no more than the budget plus llama.cpp's fixed costs (`FIXED`) over its baseline
  (interpreter, libraries, tokenizer), requantizing in a child process;
- the lossless strategy (the file mapped, experts paged under a bound) decodes the same greedy tokens as
  the model loaded whole, while the process holds at most the dense weights, the bound and one step's
  experts between steps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from budget_child import ROOT, run_child, tiny_moe_gguf

MB = 2**20
# llama.cpp's context and thread pool, the engine's buffers, huge-page rounding: fixed costs the planner keeps
# in its interpreter overhead (planners/memory.py LOCAL_OVERHEAD), 11 MB measured on this model
FIXED = 16 * MB

_SESSION = """
import json, sys
from twinfer.app import OpenOptions, open_session
from twinfer.backends.llamacpp._lib import load_llama_cpp
from twinfer.runtime.engine import SamplingParams
from twinfer.runtime.tokenizer import load_tokenizer
path, budget = sys.argv[1], sys.argv[2]
load_llama_cpp(), load_tokenizer(path)  # the baseline holds the libraries and the tokenizer
base = status()
session = open_session(OpenOptions(path, 'llamacpp', max_seqs=1, threads=1,
                                   memory_budget=None if budget == 'none' else budget))
engine = session.engine()
out = engine.generate([list(range(3, 40))], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
print(json.dumps(dict(base=base, end=status(), tokens=out[0].token_ids, ctx=session.ctx,
                      summary=session.strategy.summary() if session.strategy else None)))
"""

_RUNNER = """
import json, sys
from twinfer.backends.llamacpp.options import LlamaCppOptions
from twinfer.backends.llamacpp.runner import LlamaCppRunner
from twinfer.runtime.batch import SeqChunk, StepBatch
from twinfer.backends.llamacpp._lib import load_llama_cpp
path, bound = sys.argv[1], sys.argv[2]
load_llama_cpp()
base = status()
paged = None if bound == 'none' else int(bound)
runner = LlamaCppRunner(path, LlamaCppOptions(n_ctx=256, max_seqs=1, n_threads=1, huge_pages=False,
                                              paged_experts_bytes=paged))
table = list(range(16))
logits = runner.step(StepBatch([SeqChunk(1, list(range(3, 40)), 0, table)]))
token, pos, tokens, rss = int(logits[-1].argmax()), 37, [], []
for _ in range(24):
    logits = runner.step(StepBatch([SeqChunk(1, [token], pos, table)]))
    token, pos = int(logits[-1].argmax()), pos + 1
    tokens.append(token)
    rss.append(status()['VmRSS'])
print(json.dumps(dict(base=base, end=status(), tokens=tokens, max_rss=max(rss), pager=runner.describe()['paged_experts'])))
"""


@pytest.fixture(scope="module")
def moe_gguf() -> Path:
    return tiny_moe_gguf()


def test_half_budget_holds_from_the_os(moe_gguf: Path, tmp_path: Path) -> None:
    """The process grows by at most the budget (half the file) over its baseline; unlimited, by the file."""
    size = moe_gguf.stat().st_size
    budget = size // 2
    env = {"TWINFER_CACHE": str(tmp_path)}
    capped = run_child(_SESSION, str(moe_gguf), str(budget), env=env)
    grown = capped["end"]["VmHWM"] - capped["base"]["VmRSS"]
    assert grown <= budget + FIXED, (grown / MB, capped["summary"])
    assert "memory budget" in capped["summary"] and "KL" in capped["summary"]  # what was chosen, and its cost
    whole = run_child(_SESSION, str(moe_gguf), "none", env=env)
    assert whole["end"]["VmHWM"] - whole["base"]["VmRSS"] > size  # the model as stored does not fit: a real test


def test_paged_experts_are_lossless_and_bounded(moe_gguf: Path) -> None:
    """Mapped with experts paged under a 6 MB bound: the same greedy tokens as the model loaded whole, and
    between steps the process holds the dense weights, the bound and a step's experts, not the file."""
    whole = run_child(_RUNNER, str(moe_gguf), "none")
    bound = 6 * MB
    paged = run_child(_RUNNER, str(moe_gguf), str(bound))
    assert paged["tokens"] == whole["tokens"] and len(set(whole["tokens"])) > 1
    pager = paged["pager"]
    assert pager["experts_mb"] > 0.9 * moe_gguf.stat().st_size / MB and pager["trims"] > 1
    step = 8 * 4 * 3 * 256 * 192 * 2  # a token's top-4 experts in each of 8 layers, BF16
    held = paged["max_rss"] - paged["base"]["VmRSS"]
    anon = paged["end"]["RssAnon"] - paged["base"]["RssAnon"]  # KV cache and compute buffers
    assert held <= anon + (pager["dense_mb"] + 1) * MB + bound + step + 4 * MB, (held / MB, anon / MB, pager)
    assert whole["max_rss"] - whole["base"]["VmRSS"] > moe_gguf.stat().st_size  # loaded whole: the file is held
    # the load left the file unread (lazymap.py) and the pager made room layer by layer: the peak, prompt
    # included, is nowhere near the file; the router's choices were read ahead (routing.Prefetch)
    layer = moe_gguf.stat().st_size / 8  # about one layer's experts: what a prompt maps at once
    peak = paged["end"]["VmHWM"] - paged["base"]["VmRSS"]
    assert peak <= anon + (pager["dense_mb"] + 1) * MB + bound + layer + step + 4 * MB, (peak / MB, pager)
    assert pager["fetches"] >= 24 * 8 * 4 and pager["trims"] > 24  # every decode step, every layer


def test_lazy_map_finds_llama_cpps_mmap_slot() -> None:
    """The slot `unpopulated` repoints is found in the installed libllama, and nothing else is touched."""
    llama_cpp = pytest.importorskip("llama_cpp")
    if not Path("/proc/self/maps").exists():
        pytest.skip("Linux only")
    from twinfer.backends.llamacpp import lazymap

    library = os.path.realpath(llama_cpp.llama_cpp._lib._name)
    assert lazymap.got_slots(Path(library).read_bytes(), "mmap")
    assert lazymap.got_slots(b"not an ELF file", "mmap") == []
    with lazymap.unpopulated(library) as slots:
        assert slots >= 1
    with lazymap.unpopulated(ROOT / "README.md") as slots:  # not loaded here: the load stays as it was
        assert slots == 0


def test_paged_experts_are_never_repacked() -> None:
    """Repacked tensors are copied out of the mapping into anonymous memory (a gpt-oss-shaped MXFP4 + Q8_0
    file peaked at 3.5 GB for its 1.8 GB, and every run under budget + 600 MB was OOM-killed), so a paged
    plan turns the fast mode's repacking off."""
    from dataclasses import replace

    from twinfer.backends.llamacpp.options import options_for_mode

    fast = options_for_mode("fast", n_ctx=256, max_seqs=1)
    assert fast.repack and not replace(fast, paged_experts_bytes=MB, huge_pages=False).repack


def test_bench_takes_the_budget_as_the_session_does(moe_gguf: Path, tmp_path: Path) -> None:
    """`twinfer bench --memory-budget` opens the model through the same session options as generate and serve,
    and reports what the budget chose; against a server (--url) the server's own budget applies."""
    from twinfer.cli.bench_cmd import BenchOptions
    from twinfer.runtime.errors import OptionError

    options = BenchOptions(str(moe_gguf), "1", memory_budget="40MB", allow_pruning=True)
    opened = options.open_options()
    assert (opened.memory_budget, opened.allow_pruning, opened.max_seqs) == ("40MB", True, 1)
    with pytest.raises(OptionError, match="memory-budget"):
        BenchOptions(url="http://127.0.0.1:1", memory_budget="40MB")
    result = subprocess.run([sys.executable, "-m", "twinfer.cli.main", "bench", str(moe_gguf), "-c", "1", "-p", "8",
                             "-o", "8", "--requests-per-client", "1", "--threads", "1", "--memory-budget",
                             str(moe_gguf.stat().st_size // 2), "--json"], capture_output=True, text=True,
                            timeout=600, cwd=ROOT, env={**os.environ, "TWINFER_CACHE": str(tmp_path)})
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert report["memory_budget"].startswith("memory budget 40 MB") and report["results"][0]["output_tokens_per_s"] > 0


def test_cgroup_headroom_keeps_weights_mapped_in_a_container(tmp_path: Path) -> None:
    """Huge-page loading weighs the model against the memory cgroup's room (limit minus anonymous memory,
    the least over the group and its ancestors), so an unbudgeted run in a container maps what would not fit."""
    from twinfer.backends.llamacpp.hugepages import cgroup_headroom, wanted

    own = tmp_path / "cgroup"
    own.write_text("4:memory:/box/run\n0::/\n")
    for folder, limit, rss in (("memory/box", 3 * 10**9, 10**9), ("memory/box/run", "9223372036854771712", 0)):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "memory.limit_in_bytes").write_text(f"{limit}\n")
        (tmp_path / folder / "memory.stat").write_text(f"cache 5000\ntotal_rss {rss}\ntotal_cache 7\n")
    room = cgroup_headroom(str(tmp_path), str(own))
    assert room == 2 * 10**9  # the parent's 3 GB limit less its 1 GB of anonymous memory; the child is unlimited
    assert wanted(10**9, "madvise", room) and not wanted(int(1.66e9), "madvise", room)
    own.write_text("0::/\n")
    assert cgroup_headroom(str(tmp_path), str(own)) is None  # no v2 memory.max here: no limit


def test_a_budget_only_batch_one_fits_names_max_seqs(moe_gguf: Path) -> None:
    """Expert paging is a batch-1 plan: a server's budget that fits only at one request at a time says so,
    beside the budget that would hold every sequence."""
    from twinfer.app.budget import llamacpp_strategy
    from twinfer.runtime.errors import PlanError
    from twinfer.runtime.loaders import load_model

    loaded, budget = load_model(moe_gguf), moe_gguf.stat().st_size // 2
    assert llamacpp_strategy(loaded, budget, 4096, 1, False).expert_cache_bytes  # paged at batch 1
    with pytest.raises(PlanError, match=r"raise --memory-budget to \d+ MB.*; or compute one request at a "
                                        r"time \(--max-seqs 1\): .*stream \d+% of experts fits"):
        llamacpp_strategy(loaded, budget, 4096, 16, False)
