"""The engine over the llama.cpp runner on the default model.

llama.cpp's CPU kernels are not batch-invariant (a row's logits depend on the rows sharing its
llama_decode call; its own `Llama` differs between n_batch 1 and 512), so exact equality with a
request run alone is asserted in the engine's batch-invariant mode: prompt chunks run alone at fixed
boundaries, decode steps hold 2 to 7 rows, and (for arrivals at any time) each sequence has its own
KV stream (`unified_kv=False`), so its cells lie where they would alone. The default mode is checked
for block accounting, prefix reuse and completion.
"""

from __future__ import annotations

import random
from dataclasses import replace
from functools import cache

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from twinfer.app.models import open_model
from twinfer.backends.llamacpp.runner import LlamaCppRunner
from twinfer.runtime.batch import LogitsWanted, SeqChunk, StepBatch
from twinfer.runtime.corpus import corpus_prompts
from twinfer.runtime.engine import Engine, EngineConfig, GuardConfig, SamplingParams

CTX = 1024
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, guard=GuardConfig(enabled=False), ignore_eos=True)


@cache
def _opened(ctx: int, seqs: int, unified: bool = True):  # noqa: ANN202
    return open_model(None, "llamacpp", max_seqs=seqs, ctx=ctx, threads=2, kv_layout="unified" if unified else "streams")


def engine(ctx: int = 1024, seqs: int = 8, unified: bool = True, **config: int | bool) -> Engine:
    opened = _opened(ctx, seqs, unified)
    for _ in range(10_000):  # a fresh engine: drop whatever an earlier one left in the slots
        if not opened.runner._slots:  # noqa: SLF001
            break
        opened.runner.release(next(iter(opened.runner._slots)))  # noqa: SLF001
    return Engine(opened.runner, opened.tokenizer, EngineConfig(**config))  # type: ignore[arg-type]


@cache
def prompts() -> list[list[int]]:
    tok = _opened(1024, 8).tokenizer
    texts = corpus_prompts("prose", 6, 120) + corpus_prompts("code", 6, 90)
    return [tok.encode(t) for t in texts]


@cache
def alone(i: int) -> tuple[int, ...]:
    e = engine(batch_invariant=True, max_prefill_chunk=32)  # the same prompt chunks as the batched runs
    return tuple(e.generate([prompts()[i]], GREEDY)[0].token_ids)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 1000))
def test_invariant_mode_batch_equals_alone(seed: int) -> None:
    """Any subset, order and batch width: equal to alone. (Over a unified cache, requests arriving
    while others decode can still differ -- their cells interleave -- hence per-sequence streams below.)"""
    rng = random.Random(seed)
    order = rng.sample(range(len(prompts())), rng.randrange(2, 8))
    e = engine(ctx=CTX, seqs=8, batch_invariant=True, max_prefill_chunk=32)
    ids = {e.add_request(prompts()[i], GREEDY): i for i in order}
    while e.has_work:
        e.step()
        e.blocks.check()
    for rid, i in ids.items():
        assert e.requests[rid].finish_reason == "length"
        assert tuple(e.requests[rid].output) == alone(i), f"prompt {i} differs"
    assert e.blocks.num_used == 0


@cache
def alone_in_stream(i: int) -> tuple[int, ...]:
    e = engine(ctx=256, seqs=8, unified=False, batch_invariant=True, max_prefill_chunk=32)
    return tuple(e.generate([prompts()[i]], GREEDY_24)[0].token_ids)


GREEDY_24 = SamplingParams(max_tokens=24, temperature=0.0, guard=GuardConfig(enabled=False), ignore_eos=True)


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 1000))
def test_invariant_mode_random_arrivals_equal_alone(seed: int) -> None:
    """Requests arriving while others decode, over per-sequence KV streams: each equals itself alone."""
    rng = random.Random(seed)
    pending = rng.sample(range(len(prompts())), 6)
    e = engine(ctx=256, seqs=8, unified=False, batch_invariant=True, max_prefill_chunk=32)
    assert e.max_context == 256 and e.blocks.enable_prefix_cache is False
    ids, steps = {}, 0
    while pending or e.has_work:
        if pending and (not e.has_work or rng.random() < 0.2):
            i = pending.pop(0)
            ids[e.add_request(prompts()[i], GREEDY_24)] = i
        e.step()
        e.blocks.check()
        steps += 1
    assert steps > 24  # arrivals really did interleave with decoding
    for rid, i in ids.items():
        assert tuple(e.requests[rid].output) == alone_in_stream(i), f"prompt {i} differs"
    assert e.blocks.num_used == 0


def test_per_sequence_streams_share_a_prefix_by_copying_the_stream() -> None:
    """A copied prefix is the source's KV bit for bit: continuing it gives the logits of computing the
    prefix in the copy's own stream, also when the source is released (its slot reused in the step
    that applies the copy) and when a copy is copied again."""
    runner = _opened(256, 8, False).runner
    assert runner.kv.max_seq_tokens == 256 and runner.kv.copies_prefix and runner.describe()["unified_kv"] is False
    prompt = [t for p in prompts() for t in p][:100]
    runner.step(StepBatch([SeqChunk(910, prompt[:80], 0, logits=LogitsWanted.NONE)]))
    fresh = runner.step(StepBatch([SeqChunk(910, prompt[80:], 80)]))[0]
    runner.step(StepBatch([SeqChunk(900, prompt, 0)]))
    runner.copy_prefix(900, 901, 80)
    runner.release(900)
    runner.copy_prefix(901, 902, 80)
    out = runner.step(StepBatch([SeqChunk(903, prompt[:30], 0), SeqChunk(901, prompt[80:], 80),
                                 SeqChunk(902, prompt[80:], 80)]))
    assert np.array_equal(out[1], fresh) and np.array_equal(out[2], fresh)
    assert runner.num_stored(901) == runner.num_stored(902) == 100
    for seq in (901, 902, 903, 910):
        runner.release(seq)


def test_streams_reuse_prefixes_in_the_engine() -> None:
    """The engine keeps prefix reuse over per-sequence streams (`twinfer serve --kv-layout streams`)."""
    e = engine(ctx=256, seqs=8, unified=False)
    head = [t for p in prompts()[:4] for t in p][:64]
    outs = e.generate([head + prompts()[i] for i in (5, 6, 7)], GREEDY)
    outs += e.generate([head + prompts()[8]], GREEDY)
    assert all(len(o.token_ids) == GREEDY.max_tokens for o in outs)
    assert e.blocks.hit_rate() > 0
    e.blocks.check()
    e.kv_sync.close()  # give the kept slots back for the tests after this one


def test_per_sequence_streams_decode_in_slot_order_and_reuse_the_lowest_slot(monkeypatch: pytest.MonkeyPatch) -> None:
    """llama.cpp cuts a streams batch into ubatches of consecutive increasing seq ids, so the runner
    decodes chunks in slot order: rows still come back in batch order, and a freed low slot is reused first."""
    runner = _opened(256, 8, False).runner
    fill = runner._batch.fill  # noqa: SLF001
    submitted: list[list[int]] = []

    def spy(chunks, pieces, slots):  # noqa: ANN001, ANN202
        submitted.append([slots[p.chunk] for p in pieces])
        return fill(chunks, pieces, slots)

    monkeypatch.setattr(runner._batch, "fill", spy)  # noqa: SLF001
    ids = [910, 911, 912]
    for seq, p in zip(ids, prompts()[:3], strict=True):
        runner.step(StepBatch([SeqChunk(seq, p[:12], 0)]))
    assert [runner._slots[s] for s in ids] == [0, 1, 2]  # noqa: SLF001
    rows = [SeqChunk(s, [p[12]], 12) for s, p in zip(ids, prompts()[:3], strict=True)]
    scored = SeqChunk(ids[1], prompts()[1][12:15], 12, logits=LogitsWanted.ALL)  # three rows of its own
    forward = runner.step(StepBatch([rows[0], scored, rows[2]]))
    backward = runner.step(StepBatch([rows[2], scored, rows[0]]))  # the same chunks, slots out of order
    assert forward.shape == backward.shape == (5, runner.n_vocab)
    assert np.array_equal(backward[0], forward[4]) and np.array_equal(backward[4], forward[0])
    assert np.array_equal(backward[1:4], forward[1:4])
    assert submitted[-1] == submitted[-2] == [0, 1, 2]  # what llama.cpp saw: slot order both times
    runner.release(910)
    runner.release(911)
    runner.step(StepBatch([SeqChunk(913, prompts()[3][:4], 0)]))
    assert runner._slots[913] == 0  # noqa: SLF001
    for seq in (912, 913):
        runner.release(seq)


def test_a_step_over_scattered_slots_moves_them_into_one_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """llama.cpp cuts a streams step into ubatches of consecutive slots, each a pass over the weights. Rows
    in slots 0, 2 and 3 (1 freed) become one run: the sequence in 3 moves to 1 (its stream copied), and its
    rows there are the bits of the same sequences never moved; where a copy would cost more than the pass
    it saves, nothing moves."""
    runner = _opened(256, 8, False).runner
    fill = runner._batch.fill  # noqa: SLF001
    submitted: list[list[int]] = []
    monkeypatch.setattr(runner._batch, "fill", lambda chunks, pieces, slots: (  # noqa: SLF001
        submitted.append([slots[p.chunk] for p in pieces]), fill(chunks, pieces, slots))[1])
    moved, kept, ref = [920, 921, 922, 923], [940, 941, 942, 943], [930, 932, 933]
    for seq, p in zip(moved + ref, prompts()[:4] + [prompts()[i] for i in (0, 2, 3)], strict=True):
        runner.step(StepBatch([SeqChunk(seq, p[:12], 0)]))
    runner.release(921)
    before = runner.slot_moves
    rows = [runner.step(StepBatch([SeqChunk(s, [prompts()[i][12 + k]], 12 + k) for s, i in zip(seqs, (0, 2, 3),
                                                                                                   strict=True)]))
            for k in range(2) for seqs in ([920, 922, 923], ref)]
    assert runner.slot_moves == before + 1 and [runner._slots[s] for s in (920, 922, 923)] == [0, 2, 1]  # noqa: SLF001
    assert submitted[-4] == [0, 1, 2] and submitted[-3] == [4, 5, 6]  # one run each: one ubatch each
    assert np.array_equal(rows[0], rows[1]) and np.array_equal(rows[2], rows[3])
    for seq in (920, 922, 923, *ref):
        runner.release(seq)
    for seq, p in zip(kept, prompts()[:4], strict=True):
        runner.step(StepBatch([SeqChunk(seq, p[:12], 0)]))
    runner.release(941)
    monkeypatch.setattr(runner, "_stream_bytes", runner._weight_bytes)  # noqa: SLF001
    runner.step(StepBatch([SeqChunk(s, [prompts()[i][12]], 12) for s, i in zip((940, 942, 943), (0, 2, 3), strict=True)]))
    assert [runner._slots[s] for s in (940, 942, 943)] == [0, 2, 3] and runner.slot_moves == before + 1  # noqa: SLF001
    for seq in (940, 942, 943):
        runner.release(seq)


def test_a_kept_prefix_in_the_way_gives_its_slot_to_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """A finished sequence kept for its prefix (slot 1) splits the next step's rows (slots 0, 2 and the new
    request's 3): with copies priced out, the kept one is dropped and the new request takes slot 1."""
    e = engine(ctx=256, seqs=8, unified=False)
    runner = e.runner
    monkeypatch.setattr(runner, "_stream_bytes", runner._weight_bytes)  # noqa: SLF001
    short = replace(GREEDY, max_tokens=2)
    a, b, c = (e.add_request(prompts()[i], GREEDY if i != 1 else short) for i in (0, 1, 2))
    while not e.requests[b].finished:
        e.step()
    assert list(runner.kept.retained) == [e.requests[b].seq_id] and runner._slots[e.requests[b].seq_id] == 1  # noqa: SLF001
    drops = runner.slot_drops
    d = e.add_request(prompts()[3], short)
    e.step()
    assert runner.slot_drops == drops + 1 and not runner.kept.retained
    assert sorted(runner._slots[e.requests[r].seq_id] for r in (a, c, d)) == [0, 1, 2]  # noqa: SLF001
    while e.has_work:
        e.step()
        e.blocks.check()
    assert all(len(e.requests[r].output) == e.requests[r].params.max_tokens for r in (a, b, c, d))
    e.kv_sync.close()


def test_default_mode_random_arrivals_tiny_pool_finish_without_leaks() -> None:
    rng = random.Random(5)
    e = engine(ctx=256, seqs=8, max_batch_tokens=48, max_prefill_chunk=24)  # 16 blocks of 16
    pending = list(range(len(prompts())))
    while pending or e.has_work:
        if pending and (not e.has_work or rng.random() < 0.5):
            e.add_request(prompts()[pending.pop(0)], GREEDY)
        e.step()
        e.blocks.check()
    assert all(r.finish_reason == "length" and len(r.output) == 8 for r in e.requests.values())
    assert e.blocks.num_used == 0


def test_default_mode_accounting_and_prefix_reuse() -> None:
    e = engine(ctx=1024, seqs=8, max_batch_tokens=256)
    shared = prompts()[0]
    batch = [shared + p[1:20] for p in prompts()[1:7]]
    first = e.generate([shared], GREEDY)[0]
    outs = e.generate(batch, GREEDY)
    assert all(o.finish_reason == "length" and len(o.token_ids) == 8 for o in outs)
    assert all(o.cached_tokens >= len(shared) // 16 * 16 - 16 for o in outs), [o.cached_tokens for o in outs]
    assert e.blocks.num_used == 0
    again = e.generate([shared], GREEDY)[0]
    assert again.cached_tokens > 0 and len(again.token_ids) == len(first.token_ids)


def test_default_step_is_llama_servers_batch_and_a_wave_prefills_in_one_step() -> None:
    e = engine(ctx=CTX, seqs=8)
    assert e.scheduler.config.max_batch_tokens == LlamaCppRunner.step_tokens == 2048
    wave = [(p * 5)[:100] for p in prompts()[:8]]  # 800 prompt tokens: one step at 2048, two at 512
    for p in wave:
        e.add_request(p, GREEDY)
    e.step()
    assert all(r.num_computed >= len(r.prompt) for r in e.requests.values())
    while e.has_work:
        e.step()
    small = engine(ctx=CTX, seqs=8, max_batch_tokens=512)
    assert small.scheduler.config.max_batch_tokens == 512
    for p in wave:
        small.add_request(p, GREEDY)
    small.step()
    assert sum(r.num_computed >= len(r.prompt) for r in small.requests.values()) < len(wave)
    while small.has_work:
        small.step()
    with pytest.raises(ValueError, match="positive"):  # an explicit 0 is an error, not the runner's default
        engine(ctx=CTX, seqs=8, max_batch_tokens=0)


@pytest.mark.parametrize("unified", [True, False])
def test_a_full_house_takes_over_the_kept_slot_holding_the_prompt(unified: bool) -> None:
    """Every slot busy: a request whose prompt a finished sequence's slot still holds takes that slot over
    (as llama-server does) instead of computing the prompt again; its text is the one a copied prefix gives."""
    head = [t for p in prompts()[:4] for t in p][:64]  # four blocks of 16
    prompt, other = head + prompts()[5][1:7], prompts()[6]
    texts = []
    for seqs in (2, 8):  # 2: no slot free for a copy; 8: the copy path
        e = engine(ctx=256, seqs=seqs, unified=unified)
        e.generate([head], GREEDY)  # finishes; its slot keeps the prompt
        e.add_request(other, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
        rid = e.add_request(prompt, GREEDY)
        while e.has_work:
            e.step()
            e.blocks.check()
        texts.append(e.requests[rid].output)
        assert e.requests[rid].cached_tokens == 64, seqs
        assert len(e.kv_sync.retained) <= seqs and set(e.runner._slots) == set(e.kv_sync.retained)  # noqa: SLF001
        e.kv_sync.close()
    assert texts[0] == texts[1] and len(texts[0]) == GREEDY.max_tokens


def test_abort_frees_blocks_and_slot() -> None:
    e = engine()
    rid = e.add_request(prompts()[2], SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
    for _ in range(3):
        e.step()
    assert e.blocks.num_used > 0
    e.abort(rid)
    assert e.blocks.num_used == 0
    e.blocks.check()


def test_invariant_preemption_equals_alone() -> None:
    """A preempted request recomputes its prompt and replays its output; over its own KV stream it then
    equals itself alone. (Over a unified cache it may not: its recomputed cells land wherever cells are
    free, out of position order, and the flash attention's sums run in cell order. One host's build
    flipped a near-tie that way, another's did not.) A 16-block pool, smaller than the streams, forces
    the preemptions."""
    base = engine(ctx=256, seqs=8, unified=False, batch_invariant=True, max_prefill_chunk=32)
    runner, layout = base.runner, base.runner.kv
    params = SamplingParams(max_tokens=40, temperature=0.0, guard=GuardConfig(enabled=False), ignore_eos=True)
    picks = [0, 6, 7, 1, 2, 8]
    runner.kv = replace(layout, num_blocks=16)
    try:
        e = Engine(runner, base.tokenizer, EngineConfig(batch_invariant=True, max_prefill_chunk=32))
        outs = e.generate([prompts()[i] for i in picks], params)
    finally:
        runner.kv = layout
    assert e.scheduler.preemptions > 0
    for i, out in zip(picks, outs, strict=True):
        ref = engine(ctx=256, seqs=8, unified=False, batch_invariant=True, max_prefill_chunk=32).generate(
            [prompts()[i]], params)[0]
        assert out.token_ids == ref.token_ids
