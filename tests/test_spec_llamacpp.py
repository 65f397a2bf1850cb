"""Speculative decoding over the llama.cpp runner on the default model.

llama.cpp's CPU kernels are not batch-invariant, so verification is exact only where the chunk
shapes allow. A verification chunk of up to 7 tokens of one sequence gives, row for row, the same
logits as decoding those tokens one per step (8 do not: another matmul path), hence
SpecConfig.max_k = 6 -- but only while the cache holds at most 256 cells: beyond that a lone query
row takes ggml's split-KV flash attention, which sums over threads in another order than any
multi-row step. So in the default mode, single-stream greedy output is identical with and without
speculation for short contexts; in the engine's batch-invariant mode the runner pads lone rows (with
its reserved sequence) and is exact at any length, speculating while one request runs.
"""

from __future__ import annotations

from functools import cache

import numpy as np
import pytest
from test_engine_llamacpp import _opened
from test_spec_parts import LLAMA_STEP_SECONDS, fixed_costs

from twinfer.runtime.batch import LogitsWanted, SeqChunk, StepBatch
from twinfer.runtime.corpus import corpus_prompts
from twinfer.runtime.engine import Engine, EngineConfig, GuardConfig, SamplingParams
from twinfer.runtime.errors import TwinferError
from twinfer.runtime.speculative import (
    DraftModelProposer,
    NgramProposer,
    Proposer,
    SelfDraftProposer,
    SpecConfig,
)

GREEDY = SamplingParams(max_tokens=48, temperature=0.0, guard=GuardConfig(enabled=False), ignore_eos=True)
ALWAYS = SpecConfig(adaptive=False)  # draft max_k tokens every step


def _runner():  # noqa: ANN202
    runner = _opened(1024, 8).runner
    for seq in list(runner._slots):  # noqa: SLF001 - a fresh start for every engine
        runner.release(seq)
    return runner


def engine(proposer: Proposer | None = None, spec: SpecConfig = ALWAYS, **config: int | bool) -> Engine:
    opened = _opened(1024, 8)
    return Engine(_runner(), opened.tokenizer, EngineConfig(spec=spec, **config), proposer)  # type: ignore[arg-type]


@cache
def prompts() -> list[list[int]]:
    """Six short prompts (prompt + output stay below 256 cells), then two of over 300 tokens."""
    tok = _opened(1024, 8).tokenizer
    texts = corpus_prompts("code", 3, 400) + corpus_prompts("prose", 3, 400)
    return [tok.encode(t) for t in texts + corpus_prompts("code", 2, 1300)]


@cache
def plain(i: int, invariant: bool = False) -> tuple[int, ...]:
    """Greedy tokens without speculation (prompt chunks as in the speculating runs: they matter)."""
    e = engine(batch_invariant=True, max_prefill_chunk=32) if invariant else engine()
    return tuple(e.generate([prompts()[i]], GREEDY)[0].token_ids)


def test_verification_chunks_up_to_7_tokens_equal_one_token_steps() -> None:
    runner, prompt = _runner(), prompts()[0]
    logits = runner.step(StepBatch([SeqChunk(0, prompt, 0)]))[0]
    generated, reference = [], []
    for _ in range(14):  # decode one token per step: reference[j] predicts generated[j]
        reference.append(logits)
        generated.append(int(np.argmax(logits)))
        logits = runner.step(StepBatch([SeqChunk(0, generated[-1:], len(prompt) + len(generated) - 1)]))[0]
    reference.append(logits)
    for n in (2, 4, 7):
        for j in (0, n - 1):  # the second chunk starts below the stored length: the runner rolls back
            chunk = SeqChunk(0, generated[j : j + n], len(prompt) + j, logits=LogitsWanted.ALL)
            rows = runner.step(StepBatch([chunk]))
            for m in range(n):
                assert np.array_equal(rows[m], reference[j + m + 1]), f"{n}-token chunk, row {m} differs"
    runner.release(0)


@pytest.mark.parametrize("i", [0, 1, 3])
def test_ngram_greedy_identical_single_stream(i: int) -> None:
    e = engine(NgramProposer())
    out = e.generate([prompts()[i]], GREEDY)[0]
    assert tuple(out.token_ids) == plain(i)
    stats = e.metrics.snapshot()["speculative"]
    assert stats["proposed"] > 0 and stats["accepted"] > 0
    assert e.blocks.num_used == 0


def test_ngram_adaptive_greedy_identical_cold_and_warm() -> None:
    """Adaptive k, and a second request served from blocks cached under speculation (its prompt tail
    is then computed as a shorter chunk, so it is compared with the same warm run without drafts)."""
    runs = []
    for proposer in (None, NgramProposer()):
        e = engine(proposer, spec=SpecConfig())
        if proposer is not None:
            fixed_costs(e.speculator, LLAMA_STEP_SECONDS)  # decisions must not depend on the host's load
        cold = e.generate([prompts()[2]], GREEDY)[0]
        warm = e.generate([prompts()[2]], GREEDY)[0]
        assert warm.cached_tokens > 0
        runs.append((cold.token_ids, warm.token_ids))
    assert runs[0] == runs[1] and tuple(runs[0][0]) == plain(2)
    assert e.metrics.snapshot()["speculative"]["accepted"] > 0


def test_draft_model_same_gguf_greedy_identical() -> None:
    from twinfer.backends.llamacpp import LlamaCppOptions, LlamaCppRunner

    opened = _opened(1024, 8)
    with LlamaCppRunner(opened.path, LlamaCppOptions(n_ctx=1024, max_seqs=8, n_threads=2), spec=opened.runner.spec) as draft:
        e = engine(DraftModelProposer(draft))
        out = e.generate([prompts()[1]], GREEDY)[0]
        assert tuple(out.token_ids) == plain(1)
        stats = e.metrics.snapshot()["speculative"]
        assert stats["acceptance_rate"] > 0.9, stats  # the target drafting for itself
        e.close()


def test_ngram_invariant_mode_equals_plain() -> None:
    """Batch-invariant mode verifies drafts only while one request runs (a rollback next to another
    sequence would reorder KV cells): alone it speculates, together the streams decode plainly."""
    picks = [0, 3, 4]
    runs = []
    for proposer in (None, NgramProposer()):
        e = engine(proposer, batch_invariant=True, max_prefill_chunk=32)
        alone = e.generate([prompts()[4]], GREEDY)[0]
        together = e.generate([prompts()[i] for i in picks], GREEDY)
        runs.append([alone.token_ids] + [o.token_ids for o in together])
    assert runs[0] == runs[1] and tuple(runs[0][0]) == plain(4, invariant=True)
    assert e.metrics.snapshot()["speculative"]["accepted"] > 0


@pytest.mark.parametrize("i", [6, 7])
def test_ngram_invariant_mode_long_context_equals_plain(i: int) -> None:
    assert len(prompts()[i]) > 300
    e = engine(NgramProposer(), batch_invariant=True, max_prefill_chunk=32)
    assert tuple(e.generate([prompts()[i]], GREEDY)[0].token_ids) == plain(i, invariant=True)
    assert e.metrics.snapshot()["speculative"]["accepted"] > 0


def test_invariant_mode_pads_lone_rows_so_long_contexts_batch_exactly() -> None:
    """Past 256 cells a lone decode row would take flash attention's split-KV path; padded, two
    long streams decoding together equal each alone (no speculation involved)."""
    e = engine(batch_invariant=True, max_prefill_chunk=32)
    assert e.pad_lone_rows
    together = e.generate([prompts()[6], prompts()[7]], GREEDY)
    assert [tuple(o.token_ids) for o in together] == [plain(6, invariant=True), plain(7, invariant=True)]


def test_self_speculation_is_refused_with_a_clear_error() -> None:
    with pytest.raises(TwinferError, match="draft:PATH"):
        SelfDraftProposer(_runner(), 4)
