"""Engine on the torch runner with a tiny random llama: batching, paging, prefix reuse, preemption, abort.

Every check compares greedy token ids between two code paths, so any scheduling or KV bug that
changes what the model sees shows up as a token difference.
"""

from __future__ import annotations

import random
from functools import cache

import numpy as np
import pytest
from fixtures_models import hf_canonical, hf_model, state_dict_np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from twinfer.runtime.engine import Engine, EngineConfig, GuardConfig, SamplingParams
from twinfer.runtime.engine.sampler import log_softmax
from twinfer.runtime.spec import ModelSpec

torch = pytest.importorskip("torch")
from twinfer.backends.cuda.runner import build_torch_runner  # noqa: E402

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, guard=GuardConfig(enabled=False))


@cache
def _tiny() -> tuple[ModelSpec, dict[str, np.ndarray]]:
    from twinfer.runtime.loaders.hf import spec_from_config

    model = hf_model("llama")
    spec = spec_from_config(model.config.to_dict())
    return spec, hf_canonical(state_dict_np(model), "llama", tied=False)


def engine(kv_tokens: int = 1024, block_size: int = 4, **config: int | bool) -> Engine:
    spec, weights = _tiny()
    runner = build_torch_runner(spec, weights, kv_tokens=kv_tokens, block_size=block_size)
    return Engine(runner, None, EngineConfig(**config))  # type: ignore[arg-type]


def _prompts(seed: int, n: int, vocab: int = 96) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randrange(1, 30))] for _ in range(n)]


@cache
def alone(prompt: tuple[int, ...], max_tokens: int = 10) -> tuple[int, ...]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, guard=GuardConfig(enabled=False))
    return tuple(engine().generate([list(prompt)], params)[0].token_ids)


def run_checked(e: Engine) -> dict[str, list[int]]:
    """Step to completion, checking block invariants after every step."""
    done: dict[str, list[int]] = {}
    while e.has_work:
        for out in e.step():
            if out.finished:
                done[out.request_id] = e.requests[out.request_id].output
        e.blocks.check()
    assert e.blocks.num_used == 0, "blocks leaked"
    return done


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), pool=st.integers(10, 40), budget=st.integers(1, 48),
       chunk=st.integers(1, 16))
def test_random_arrivals_tiny_pool_equal_alone(seed: int, pool: int, budget: int, chunk: int) -> None:
    rng = random.Random(seed)
    prompts = _prompts(seed, 8)
    e = engine(kv_tokens=pool * 4, max_batch_tokens=budget, max_prefill_chunk=chunk, max_seqs=6)
    pending = list(enumerate(prompts))
    ids: dict[str, int] = {}
    done: dict[str, list[int]] = {}
    while pending or e.has_work:
        if pending and (not e.has_work or rng.random() < 0.4):
            i, p = pending.pop(0)
            ids[e.add_request(p, GREEDY)] = i
        for out in e.step():
            if out.finished:
                assert out.finish_reason == "length"
                done[out.request_id] = e.requests[out.request_id].output
        e.blocks.check()
    assert e.blocks.num_used == 0
    assert len(done) == len(prompts)
    for rid, i in ids.items():
        assert tuple(done[rid]) == alone(tuple(prompts[i])), f"prompt {i} differs when batched"


def test_chunked_prefill_equals_one_shot() -> None:
    prompt = _prompts(7, 1)[0] * 3
    one_shot = engine(max_prefill_chunk=512).generate([prompt], GREEDY)[0].token_ids
    chunked = engine(max_prefill_chunk=5, max_batch_tokens=5).generate([prompt], GREEDY)[0].token_ids
    assert chunked == one_shot


def test_prefix_hit_equals_cold() -> None:
    prompt = _prompts(3, 1)[0] * 4
    e = engine()
    cold = e.generate([prompt], GREEDY)[0]
    warm = e.generate([prompt], GREEDY)[0]
    assert cold.cached_tokens == 0
    assert warm.cached_tokens == (len(prompt) - 1) // 4 * 4 > 0
    assert warm.token_ids == cold.token_ids
    assert e.blocks.hit_rate() > 0


def test_shared_prefix_between_concurrent_requests() -> None:
    base = _prompts(5, 1)[0] * 3
    prompts = [base + [1, 2, 3], base + [4, 5], base + [6]]
    e = engine()
    e.generate([base], GREEDY)
    outs = e.generate(prompts, GREEDY)
    for p, out in zip(prompts, outs, strict=True):
        assert out.cached_tokens > 0
        assert tuple(out.token_ids) == alone(tuple(p))


def test_colliding_prefix_keys_never_reuse_other_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every block key collides; the engine still reuses only blocks holding the same tokens at the
    same place, so greedy text equals a run without the prefix cache."""
    from twinfer.runtime.kv import block_manager

    monkeypatch.setattr(block_manager, "block_key", lambda parent, tokens: b"one key for every block")
    x, y, z = [3, 1, 4, 1], [5, 9, 2, 6], [53, 58, 97 % 96, 93]
    prompts = [x + y + z + [1], y + x + z + [2], x + x + x + [3], x + y + y + [4], z + y + x + [5]]
    e = engine()
    outs = [e.generate([p], GREEDY)[0] for p in prompts]
    cold = engine(enable_prefix_cache=False).generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in cold]
    assert [o.cached_tokens for o in outs] == [0, 0, 4, 4, 0]  # only x at position 0 is ever reused


def test_preempted_and_resumed_equals_undisturbed() -> None:
    prompts = _prompts(11, 6)
    params = SamplingParams(max_tokens=16, temperature=0.0, guard=GuardConfig(enabled=False))
    e = engine(kv_tokens=4 * 14, max_batch_tokens=64, max_seqs=6)
    outs = e.generate(prompts, params)
    assert e.scheduler.preemptions > 0, "the pool was meant to force preemption"
    for p, out in zip(prompts, outs, strict=True):
        assert tuple(out.token_ids) == alone(tuple(p), 16)
    assert e.blocks.num_used == 0


def test_abort_returns_every_block() -> None:
    e = engine()
    keep = e.add_request(_prompts(1, 1)[0], GREEDY)
    victim = e.add_request(_prompts(2, 1)[0] * 5, SamplingParams(max_tokens=100, temperature=0.0))
    e.step()
    e.step()
    used_before = e.blocks.num_used
    out = e.abort(victim)
    assert out is not None and out.finished and out.finish_reason == "abort"
    assert e.blocks.num_used < used_before
    e.blocks.check()
    run_checked(e)
    assert e.requests[keep].finish_reason == "length"


def test_priority_runs_first() -> None:
    e = engine(max_seqs=1)
    low = e.add_request([1, 2, 3], GREEDY, priority=5)
    high = e.add_request([4, 5, 6], GREEDY, priority=0)
    first = None
    while e.has_work and first is None:
        for out in e.step():
            if out.finished:
                first = out.request_id
    assert first == high and low in e.requests


def test_seeded_sampling_independent_of_batch() -> None:
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=20, seed=1234)
    prompt = _prompts(21, 1)[0]
    solo = engine().generate([prompt], params)[0].token_ids
    others = _prompts(22, 3)
    batched = engine().generate([*others, prompt], params)[-1].token_ids
    assert batched == solo


def test_mixed_greedy_and_sampled_rows() -> None:
    e = engine()
    prompt = _prompts(31, 1)[0]
    g = e.add_request(prompt, GREEDY)
    e.add_request(prompt, SamplingParams(max_tokens=10, temperature=1.5, seed=3))
    run_checked(e)
    assert tuple(e.requests[g].output) == alone(tuple(prompt))


def test_logprobs_are_model_log_softmax() -> None:
    spec, weights = _tiny()
    runner = build_torch_runner(spec, weights, kv_tokens=256, block_size=4)
    prompt = [3, 9, 27, 81 % 96]
    from twinfer.runtime.batch import SeqChunk, StepBatch

    logits = runner.step(StepBatch([SeqChunk(0, prompt, 0, list(range(4)))]))[0]
    e = Engine(runner, None)
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)
    out = e.generate([prompt], params)[0]
    lp = log_softmax(logits)
    assert out.logprobs is not None and out.logprobs[0].token == int(np.argmax(logits))
    assert out.logprobs[0].logprob == pytest.approx(float(lp.max()), abs=1e-4)
    top = out.logprobs[0].top
    assert top is not None and [t for t, _ in top] == list(np.argsort(-lp)[:5])


def test_top_k_one_equals_greedy_and_penalty_changes_output() -> None:
    prompt = _prompts(41, 1)[0]
    top1 = engine().generate([prompt], SamplingParams(max_tokens=10, temperature=1.0, top_k=1,
                                                     guard=GuardConfig(enabled=False)))[0]
    assert tuple(top1.token_ids) == alone(tuple(prompt))
    penalized = engine().generate([prompt], SamplingParams(max_tokens=10, temperature=0.0,
                                                           frequency_penalty=2.0, presence_penalty=2.0,
                                                           guard=GuardConfig(enabled=False)))[0]
    assert len(set(penalized.token_ids)) >= len(set(top1.token_ids))


def test_stop_token_ids_and_max_context() -> None:
    prompt = _prompts(51, 1)[0]
    expected = alone(tuple(prompt))
    params = SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=(expected[3],),
                            guard=GuardConfig(enabled=False))
    out = engine().generate([prompt], params)[0]
    assert out.finish_reason == "stop" and tuple(out.token_ids) == expected[: expected.index(expected[3])]
    e = engine(max_context=len(prompt) + 3)
    out = e.generate([prompt], GREEDY)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3


def test_bad_requests_are_rejected() -> None:
    from twinfer.runtime.errors import RequestError

    e = engine(max_context=64)
    with pytest.raises(RequestError, match="empty"):
        e.add_request([], GREEDY)
    with pytest.raises(RequestError, match="context window"):
        e.add_request(list(range(64)), GREEDY)
    with pytest.raises(RequestError, match="token ids"):
        e.add_request([1, 10_000], GREEDY)
    with pytest.raises(RequestError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(RequestError, match="top_p"):
        SamplingParams(top_p=0)
