"""Speculative decoding on the torch runner (tiny random llama, fp32: exact for any chunking).

Greedy output must be identical with and without speculation for every proposer; sampled output
must follow the same distribution (a chi-square test against the sampler's exact probabilities);
rejected drafts must leave no trace in the KV blocks or the prefix cache.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable
from functools import cache

import numpy as np
import pytest
from test_engine import _prompts, _tiny, run_checked
from test_spec_parts import LLAMA_STEP_SECONDS, fixed_costs

from twinfer.runtime.batch import SeqChunk, StepBatch
from twinfer.runtime.engine import Engine, EngineConfig, GuardConfig, SamplingParams
from twinfer.runtime.engine.sampler import RowState, apply_penalties, filtered
from twinfer.runtime.errors import TwinferError
from twinfer.runtime.runner import Runner
from twinfer.runtime.speculative import (
    Draft,
    DraftModelProposer,
    DraftQuery,
    NgramProposer,
    Proposer,
    SelfDraftProposer,
    SpecConfig,
)
from twinfer.runtime.speculative.options import parse_speculate

torch = pytest.importorskip("torch")
from twinfer.backends.cuda.runner import build_torch_runner  # noqa: E402

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, guard=GuardConfig(enabled=False))
ALWAYS = SpecConfig(adaptive=False, max_k=5)  # draft every step: exercise verification, not the controller


@cache
def _draft_weights(noise: float = 0.003) -> dict[str, np.ndarray]:
    """A second tiny model with the same vocabulary: the target's weights, perturbed."""
    _, weights = _tiny()
    rng = np.random.default_rng(0)
    return {k: (v + rng.normal(0.0, noise, v.shape)).astype(np.float32) for k, v in weights.items()}


def _runner(kv_tokens: int = 1024, weights: dict[str, np.ndarray] | None = None) -> Runner:
    spec, target = _tiny()
    return build_torch_runner(spec, weights or target, kv_tokens=kv_tokens, block_size=4)


PROPOSERS: dict[str, Callable[[Runner], Proposer]] = {
    "ngram": lambda target: NgramProposer(min_n=1),  # 1-gram matches too: more drafts, more rejections
    "draft": lambda target: DraftModelProposer(_runner(weights=_draft_weights())),
    "self": lambda target: SelfDraftProposer(target, 1),
}


def spec_engine(name: str | None, kv_tokens: int = 1024, spec: SpecConfig = ALWAYS, **config: int | bool) -> Engine:
    runner = _runner(kv_tokens)
    proposer = PROPOSERS[name](runner) if name else None
    return Engine(runner, None, EngineConfig(spec=spec, **config), proposer)  # type: ignore[arg-type]


@cache
def repetitive_prompts() -> list[list[int]]:
    """Prompts that contain their own greedy continuation, so drafts are often right (and sometimes not)."""
    e = spec_engine(None)
    outs = e.generate(_prompts(3, 6), SamplingParams(max_tokens=12, temperature=0.0, guard=GuardConfig(enabled=False)))
    return [p + o.token_ids + p[:5] for p, o in zip(_prompts(3, 6), outs, strict=True)]


@cache
def plain_greedy(max_tokens: int = 40) -> tuple[tuple[int, ...], ...]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, guard=GuardConfig(enabled=False))
    return tuple(tuple(o.token_ids) for o in spec_engine(None).generate(repetitive_prompts(), params))


# -- greedy identity --------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["ngram", "draft", "self"])
def test_greedy_identical_with_each_proposer(name: str) -> None:
    e = spec_engine(name)
    outs = e.generate(repetitive_prompts(), GREEDY)
    assert tuple(tuple(o.token_ids) for o in outs) == plain_greedy()
    stats = e.metrics.snapshot()["speculative"]
    assert stats["proposer"] == name and stats["proposed"] > 0
    assert 0 < stats["accepted"] < stats["proposed"], "both acceptance and rejection must be exercised"
    assert e.blocks.num_used == 0


@pytest.mark.parametrize("name", ["ngram", "draft", "self"])
def test_greedy_identical_under_preemption_and_random_arrivals(name: str) -> None:
    rng = random.Random(7)
    e = spec_engine(name, kv_tokens=4 * 40, max_batch_tokens=24, max_prefill_chunk=8, max_seqs=5)
    pending = list(enumerate(repetitive_prompts()))
    ids: dict[str, int] = {}
    while pending or e.has_work:
        if pending and (not e.has_work or rng.random() < 0.4):
            i, p = pending.pop(0)
            ids[e.add_request(p, GREEDY)] = i
        e.step()
        e.blocks.check()
    assert e.scheduler.preemptions > 0, "the pool was meant to force preemption"
    assert e.blocks.num_used == 0
    for rid, i in ids.items():
        assert tuple(e.requests[rid].output) == plain_greedy()[i], f"prompt {i} differs"


def test_rejected_drafts_never_enter_the_prefix_cache() -> None:
    """Every hashed block must hold the KV of exactly the tokens it was hashed with: a request served
    from blocks cached by a speculating request decodes exactly like a cold one."""
    prompt = repetitive_prompts()[1]
    e = spec_engine("ngram")
    first = e.generate([prompt], GREEDY)[0]
    assert e.metrics.snapshot()["speculative"]["accepted"] < e.metrics.snapshot()["speculative"]["proposed"]
    extended = prompt + first.token_ids  # its blocks were computed under speculation
    again = e.generate([extended], GREEDY)[0]
    assert again.cached_tokens >= len(extended) // 4 * 4 - 4
    cold = spec_engine(None).generate([extended], GREEDY)[0]
    assert again.token_ids == cold.token_ids


def test_stops_and_max_tokens_cut_inside_an_accepted_draft() -> None:
    prompt = repetitive_prompts()[0]
    expected = plain_greedy()[0]
    for max_tokens in (1, 2, 3, 7):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, guard=GuardConfig(enabled=False))
        out = spec_engine("ngram").generate([prompt], params)[0]
        assert tuple(out.token_ids) == expected[:max_tokens] and out.finish_reason == "length"
    stop = expected[5]
    params = SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=(stop,), guard=GuardConfig(enabled=False))
    out = spec_engine("ngram").generate([prompt], params)[0]
    assert tuple(out.token_ids) == expected[: expected.index(stop)] and out.finish_reason == "stop"


def test_logprobs_of_speculated_tokens_match_plain_decoding() -> None:
    params = SamplingParams(max_tokens=20, temperature=0.0, logprobs=3, guard=GuardConfig(enabled=False))
    prompt = repetitive_prompts()[2]
    plain = spec_engine(None).generate([prompt], params)[0]
    spec = spec_engine("ngram").generate([prompt], params)[0]
    assert spec.token_ids == plain.token_ids
    assert plain.logprobs is not None and spec.logprobs is not None
    for a, b in zip(plain.logprobs, spec.logprobs, strict=True):
        assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top or []] == [t for t, _ in b.top or []]


# -- sampled outputs follow the target distribution ----------------------------------------------------
SAMPLED = dict(temperature=1.0, top_k=4, repetition_penalty=1.3, guard=GuardConfig(enabled=False))


def _top(runner: Runner, tokens: list[int], k: int) -> list[int]:
    logits = runner.step(StepBatch([SeqChunk(0, tokens, 0, list(range(runner.kv.num_blocks)))]))[0]
    return [int(t) for t in np.argsort(-logits)[:k]]


@cache
def sampling_prompt() -> list[int]:
    """A prompt whose likely next tokens each appear in it followed by their greedy continuation,
    so n-gram drafts of sampled requests are sometimes accepted."""
    runner, base = _runner(), _prompts(3, 6)[3]
    lookup: list[int] = []
    for first in _top(runner, base, 4):
        seq = [*base, first]
        for _ in range(3):
            seq.append(_top(runner, seq, 1)[0])
        lookup += seq[len(base) :]
    return lookup + base


def _exact_joint(prompt: list[int], params: SamplingParams, n: int) -> dict[tuple[int, ...], float]:
    """P(first n tokens) under the sampler's own definition, by enumerating the model's top-k tree."""
    runner = _runner()
    out: dict[tuple[int, ...], float] = {}

    def walk(prefix: tuple[int, ...], prob: float) -> None:
        if len(prefix) == n:
            out[prefix] = prob
            return
        logits = runner.step(StepBatch([SeqChunk(0, prompt + list(prefix), 0, list(range(runner.kv.num_blocks)))]))[0]
        row = RowState(params, np.random.default_rng(0), prompt, Counter(prefix))
        cand, probs = filtered(apply_penalties(logits, row), row)
        for token, p in zip(cand, probs, strict=True):
            walk((*prefix, int(token)), prob * float(p))

    walk((), 1.0)
    return out


def chi_square_p(observed: Counter[tuple[int, ...]], expected: dict[tuple[int, ...], float], n: int) -> float:
    """Pearson's goodness-of-fit p-value, cells with expected count < 5 pooled (Wilson-Hilferty tail)."""
    assert set(observed) <= set(expected), "a sample fell outside the target's support"
    stat, df, pool_obs, pool_exp = 0.0, -1, 0, 0.0
    for cell, p in expected.items():
        if n * p < 5:
            pool_obs, pool_exp = pool_obs + observed[cell], pool_exp + n * p
            continue
        stat += (observed[cell] - n * p) ** 2 / (n * p)
        df += 1
    if pool_exp > 0:
        stat += (pool_obs - pool_exp) ** 2 / pool_exp
        df += 1
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.mark.parametrize("name", [None, "ngram", "draft", "self"])
def test_sampled_distribution_is_preserved(name: str | None) -> None:
    prompt = sampling_prompt()
    n_tokens, seeds = 3, 2000
    expected = _exact_joint(prompt, SamplingParams(max_tokens=n_tokens, **SAMPLED), n_tokens)  # type: ignore[arg-type]
    e = spec_engine(name, kv_tokens=4096, max_seqs=64, max_batch_tokens=1024)
    for seed in range(seeds):
        e.add_request(prompt, SamplingParams(max_tokens=n_tokens, seed=seed, **SAMPLED))  # type: ignore[arg-type]
    done = run_checked(e)
    observed = Counter(tuple(tokens) for tokens in done.values())
    assert chi_square_p(observed, expected, seeds) > 0.001
    if name is not None:
        stats = e.metrics.snapshot()["speculative"]
        assert 0 < stats["accepted"] < stats["proposed"]


# -- metrics ----------------------------------------------------------------------------------------
def test_metrics_snapshot_and_prometheus_counters() -> None:
    pytest.importorskip("prometheus_client")
    from twinfer.runtime.engine.async_engine import AsyncEngine
    from twinfer.server.metrics import ServerMetrics

    e = spec_engine("ngram")
    e.generate(repetitive_prompts()[:2], GREEDY)
    spec = e.metrics.snapshot()["speculative"]
    assert spec["proposer"] == "ngram" and spec["proposed"] >= spec["accepted"] > 0
    assert spec["acceptance_rate"] == pytest.approx(spec["accepted"] / spec["proposed"])
    assert sum(spec["draft_lengths"].values()) == spec["verifications"] and spec["speedup_estimate"] > 0
    async_engine = AsyncEngine(e)
    text = ServerMetrics(lambda: async_engine).render().decode()
    assert f'twinfer_spec_proposed_tokens_total{{proposer="ngram"}} {float(spec["proposed"])}' in text
    assert f'twinfer_spec_accepted_tokens_total{{proposer="ngram"}} {float(spec["accepted"])}' in text
    assert 'twinfer_spec_acceptance_rate{proposer="ngram"}' in text
    assert "twinfer_spec_" not in ServerMetrics(lambda: AsyncEngine(spec_engine(None))).render().decode()


def test_self_speculation_rejects_impossible_layer_counts() -> None:
    with pytest.raises(TwinferError, match="can skip 1 to 1"):
        SelfDraftProposer(_runner(), 2)
    assert parse_speculate("self:1") == ("self", "1")


class _Wrong(Proposer):
    """Always proposes a token the model never picks: adaptive k must turn speculation down."""

    name = "wrong"

    def propose(self, queries: list[DraftQuery]) -> list[Draft | None]:
        return [Draft([(q.tokens[-1] + 1) % 96] * q.k) for q in queries]


def test_adaptive_k_turns_a_useless_proposer_down_to_probes() -> None:
    runner = _runner()
    e = Engine(runner, None, EngineConfig(spec=SpecConfig(probe_every=16)), _Wrong())
    fixed_costs(e.speculator, LLAMA_STEP_SECONDS)
    params = SamplingParams(max_tokens=160, temperature=0.0, ignore_eos=True, guard=GuardConfig(enabled=False))
    rid = e.add_request(repetitive_prompts()[0], params)
    while len(e.requests[rid].output) < 60:  # long enough for the acceptance rate to sink
        e.step()
    early = dict(e.metrics.snapshot()["speculative"])
    while e.has_work:
        e.step()
    late = e.metrics.snapshot()["speculative"]
    assert late["acceptance_rate"] < 0.2 and late["verifications"] > 0
    decodes = late["decodes"] - early["decodes"]
    assert decodes >= 90 and late["verifications"] - early["verifications"] <= 3  # probes, backing off
    plain = spec_engine(None).generate([repetitive_prompts()[0]], params)[0]
    assert e.requests[rid].output == plain.token_ids
