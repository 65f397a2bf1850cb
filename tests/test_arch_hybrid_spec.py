"""Speculative decoding on the recurrent hybrids (qwen3_next): rejected drafts are taken back by state.

A verification chunk keeps the conv and delta state after each of its tokens; the next chunk, which
starts after the last accepted token, restores that one (`runtime/kv/recurrent.py`). So:

- the runner: after a chunk of 1 + 4 drafted tokens, a chunk restarting after any of them gives the
  logits of a runner that never saw the rejected tokens;
- the engine: greedy text with speculation (always drafting) equals the text without, on torch and
  MLX, for three concurrent requests: with n-gram drafts (a random model rarely repeats: most are
  rejected) and with drafts that are right for 0..k tokens, so every acceptance length occurs;
- what cannot roll back is refused with the reason: a runner keeping no drafts' states (llama.cpp),
  self-speculation over the target's own state, a recurrent draft model.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from test_arch_hybrid import BUILDERS, PROMPT_A, PROMPT_B, _weights, engine, one_thread  # noqa: F401

from twinfer.runtime.batch import LogitsWanted, SeqChunk, StepBatch
from twinfer.runtime.engine import Engine, EngineConfig, GuardConfig, SamplingParams
from twinfer.runtime.errors import TwinferError
from twinfer.runtime.kv.recurrent import DRAFT_ROLLBACK
from twinfer.runtime.speculative import (
    Draft,
    DraftModelProposer,
    DraftQuery,
    NgramProposer,
    Proposer,
    SelfDraftProposer,
    SpecConfig,
)

torch = pytest.importorskip("torch")

ALWAYS = SpecConfig(adaptive=False, max_k=4)  # draft every step: exercise verification, not the controller
PROMPTS = [PROMPT_A * 2 + [1, 2], PROMPT_B * 3, [8, 6, 7, 5, 3, 0, 9] * 2]  # repeats give n-gram drafts
TABLE = list(range(16))
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, guard=GuardConfig(enabled=False))


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("hybrid_spec"))


def _runner(root: str, backend: str, kv_tokens: int = 64) -> Any:
    spec, weights = _weights(root)
    return BUILDERS[backend](spec, weights, kv_tokens=kv_tokens, block_size=4)


@pytest.mark.parametrize("backend", sorted(BUILDERS))
def test_a_chunk_restarting_inside_the_last_one_sees_only_accepted_tokens(root: str, backend: str) -> None:
    """Prefill, verify [t, d1..d4], restart after d_j (j accepted) with a new token: the rows equal a
    runner that ran prompt + [t, d1..dj] and the new token without the rejected drafts."""
    drafted, new = [40, 41, 42, 43, 44], 77
    spec_runner, worst = _runner(root, backend), 0.0
    for seq, accepted in enumerate(range(5)):  # 0..4 drafts accepted (4: nothing taken back)
        spec_runner.step(StepBatch([SeqChunk(seq, PROMPT_A, 0, TABLE)]))
        spec_runner.step(StepBatch([SeqChunk(seq, drafted, len(PROMPT_A), TABLE, LogitsWanted.ALL)]))
        start = len(PROMPT_A) + accepted + 1
        got = spec_runner.step(StepBatch([SeqChunk(seq, [new, 5], start, TABLE, LogitsWanted.ALL)]))
        plain = _runner(root, backend)
        plain.step(StepBatch([SeqChunk(0, PROMPT_A + drafted[: accepted + 1], 0, TABLE)]))
        want = plain.step(StepBatch([SeqChunk(0, [new, 5], start, TABLE, LogitsWanted.ALL)]))
        worst = max(worst, float(np.abs(got - want).max()))
    print(f"{backend}: max |dlogit| after a restart inside the verification chunk {worst:.2e}")
    assert worst <= 1e-4


class OracleProposer(Proposer):
    """Drafts the true greedy continuation with its first j tokens right and the rest wrong, j cycling
    through 0..k with the position: every acceptance length, the full one included, gets verified."""

    name = "oracle"

    def __init__(self, texts: list[list[int]], vocab: int):
        self.texts, self.vocab = texts, vocab

    def propose(self, queries: list[DraftQuery]) -> list[Draft | None]:
        drafts: list[Draft | None] = []
        for q in queries:
            truth = next(t for t in self.texts if t[: len(q.tokens)] == q.tokens)[len(q.tokens) : len(q.tokens) + q.k]
            j = len(q.tokens) % (len(truth) + 1)
            drafts.append(Draft(truth[:j] + [(t + 1) % self.vocab for t in truth[j:]]) if truth else None)
        return drafts


def _engine(root: str, backend: str, proposer: Proposer | None = None) -> Engine:
    return Engine(_runner(root, backend, kv_tokens=512), None, EngineConfig(spec=ALWAYS), proposer=proposer)


@pytest.mark.parametrize("proposer", ["ngram", "oracle"])
@pytest.mark.parametrize("backend", sorted(BUILDERS))
def test_speculation_keeps_greedy_text(root: str, backend: str, proposer: str) -> None:
    plain = [out.token_ids for out in _engine(root, backend).generate(PROMPTS, GREEDY)]
    texts = [p + out for p, out in zip(PROMPTS, plain, strict=True)]
    drafter = NgramProposer(min_n=1) if proposer == "ngram" else OracleProposer(texts, _weights(root)[0].vocab_size)
    spec = _engine(root, backend, drafter)  # 1-gram matches too: more n-gram drafts, more rejections
    outs = [out.token_ids for out in spec.generate(PROMPTS, GREEDY)]
    assert spec.speculator is not None
    stats = spec.speculator.stats
    print(f"{backend} {proposer}: {stats.verifications} verifications, {stats.accepted}/{stats.proposed} accepted")
    assert outs == plain
    assert stats.verifications >= 3 and stats.proposed > stats.accepted
    if proposer == "oracle":
        assert stats.accepted > 0 and stats.verifications > len(PROMPTS) * GREEDY.max_tokens // ALWAYS.max_k
    states = spec.runner.ops.states
    assert states.slots.held == 0 and not states.kept, "finished sequences give back their states and kept ones"


def test_what_cannot_roll_back_is_refused_with_the_reason(root: str) -> None:
    runner = engine(root).runner
    held = runner.kv
    runner.kv = replace(held, state_rollback=0)  # a runner that keeps no drafts' states (llama.cpp's)
    with pytest.raises(TwinferError, match="recurrent state.*speculative decoding is off"):
        Engine(runner, None, EngineConfig(), proposer=NgramProposer())
    runner.kv = held
    with pytest.raises(TwinferError, match=f"at most {DRAFT_ROLLBACK} drafted tokens"):
        Engine(runner, None, EngineConfig(spec=SpecConfig(max_k=DRAFT_ROLLBACK + 1)), proposer=NgramProposer())
    with pytest.raises(TwinferError, match="self-speculation.*recurrent state"):
        SelfDraftProposer(runner, 1)
    with pytest.raises(TwinferError, match="draft model.*recurrent state"):
        DraftModelProposer(_runner(root, "torch"))
    # a restart anywhere but inside the last kept chunk is refused, not run
    runner.step(StepBatch([SeqChunk(7, PROMPT_A, 0, TABLE)]))
    runner.step(StepBatch([SeqChunk(7, [1, 2, 3], len(PROMPT_A), TABLE, LogitsWanted.ALL)]))
    with pytest.raises(ValueError, match="no state was kept there"):
        runner.step(StepBatch([SeqChunk(7, [5], len(PROMPT_A) - 1, TABLE)]))


@pytest.mark.parametrize("backend", sorted(BUILDERS))
def test_streamed_experts_runner_declares_the_state(root: str, backend: str) -> None:
    """The runner that streams routed experts from the file holds the same state and declares it as the
    resident runner does; a shared prefix is recomputed, and speculation keeps the greedy text."""
    from test_arch_hybrid import saved

    from twinfer.runtime.loaders import load_model

    if backend == "torch":
        from twinfer.backends.cuda.experts import load_streaming_torch_runner as load
    else:
        from twinfer.backends.metal.experts import load_streaming_mlx_runner as load
    runner = load(load_model(saved("next-a", root)), cache_bytes=1 << 16, kv_tokens=512, block_size=4)
    assert runner.kv.recurrent and runner.kv.state_rollback == DRAFT_ROLLBACK
    prompts = [PROMPT_A * 2 + [1, 2], PROMPT_A * 2 + [4]]  # 22 tokens in common
    plain = [out.token_ids for out in _engine(root, backend).generate(prompts, GREEDY)]
    texts = [p + out for p, out in zip(prompts, plain, strict=True)]
    e = Engine(runner, None, EngineConfig(spec=ALWAYS), proposer=OracleProposer(texts, runner.spec.vocab_size))
    outs = [e.generate([p], GREEDY)[0] for p in prompts]  # one after the other: the second could reuse
    assert [o.token_ids for o in outs] == plain and outs[1].cached_tokens == 0
