"""Speculative decoding's parts, without a model: n-gram lookup, verification rules, the adaptive
controller, the scheduler's draft room and the --speculate option."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from twinfer.runtime.engine.params import SamplingParams
from twinfer.runtime.engine.request import Request
from twinfer.runtime.engine.sampler import RowState
from twinfer.runtime.engine.scheduler import Scheduler, SchedulerConfig
from twinfer.runtime.errors import TwinferError
from twinfer.runtime.kv.block_manager import BlockManager
from twinfer.runtime.speculative.accept import verify
from twinfer.runtime.speculative.adaptive import AdaptiveK, CostModel, Ema, Window, best_k, expected_tokens
from twinfer.runtime.speculative.draft_model import kept_layers
from twinfer.runtime.speculative.metrics import SpecStats
from twinfer.runtime.speculative.ngram import NgramProposer, continuation
from twinfer.runtime.speculative.options import parse_speculate
from twinfer.runtime.speculative.proposer import Draft, DraftQuery, common_prefix
from twinfer.runtime.speculative.speculator import Speculator

# Seconds of 1..7-token steps with logits for every row, measured on the default model (llama.cpp,
# 2 threads): every verified row pays for the 262k-row output matrix.
LLAMA_STEP_SECONDS = [0.0126, 0.0242, 0.0279, 0.0309, 0.0467, 0.0512, 0.0552]


def fixed_costs(speculator: Speculator | None, seconds: list[float]) -> None:
    """Price steps of 1, 2, ... tokens at `seconds` instead of timing them: tests must not race the clock."""
    assert speculator is not None
    cost = speculator.cost
    cost.seconds = {n + 1: Window() for n in range(len(seconds))}
    for n, s in enumerate(seconds):
        for _ in range(cost.min_samples):
            cost.seconds[n + 1].add(s)
    cost.on_step = lambda *args: None  # type: ignore[method-assign]


def _row(**params: object) -> RowState:
    return RowState(SamplingParams(**params), np.random.default_rng(0), [], Counter())  # type: ignore[arg-type]


def _query(tokens: list[int], k: int = 4, seq_id: int = 0) -> DraftQuery:
    return DraftQuery(seq_id, tokens, k, _row(temperature=0.0), [])


# -- n-gram lookup ------------------------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_latest_match() -> None:
    ngram = NgramProposer(max_n=3, min_n=1)
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3]
    (draft,) = ngram.propose([_query(tokens, k=3)])
    assert draft is not None and draft.tokens == [4, 5, 9]  # the longest match (1 2 3) wins over "2 3"
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 6, 2, 3]
    (draft,) = ngram.propose([_query(tokens, k=3, seq_id=1)])
    assert draft is not None and draft.tokens == [7, 8, 6]  # "2 3" most recently followed by 7 8 6


def test_ngram_index_grows_and_rebuilds_after_a_retry() -> None:
    ngram = NgramProposer(max_n=2, min_n=2)
    assert ngram.propose([_query([5, 6, 7])]) == [None]
    assert ngram.propose([_query([5, 6, 7, 8, 5, 6])])[0] == Draft([7, 8, 5, 6])  # the loop 7 8 5 6 repeats
    assert ngram.propose([_query([5, 6, 1, 5, 6])])[0] == Draft([1, 5, 6, 1])  # output replaced: re-indexed
    ngram.release(0)
    assert 0 not in ngram._index  # noqa: SLF001


def test_continuation_repeats_the_period_past_the_end() -> None:
    assert continuation([1, 2, 3, 1, 2], 3, 5) == [1, 2, 1, 2, 1]
    assert continuation([4, 4], 1, 3) == [4, 4, 4]


def test_common_prefix() -> None:
    assert common_prefix([1, 2, 3], [1, 2, 3, 4]) == 3
    assert common_prefix([1, 2, 3, 4], [1, 2, 9]) == 2
    assert common_prefix(list(range(200)), [*range(150), -1]) == 150
    assert common_prefix([], [1]) == 0


# -- verification ---------------------------------------------------------------------------------------
def _logits(*argmaxes: int, vocab: int = 8) -> np.ndarray:
    rows = np.zeros((len(argmaxes), vocab), dtype=np.float32)
    for i, t in enumerate(argmaxes):
        rows[i, t] = 5.0
    return rows


def test_greedy_verification_keeps_the_agreeing_prefix_then_adds_the_target_token() -> None:
    row = _row(temperature=0.0)
    assert verify(_logits(3, 4, 5, 6), Draft([3, 4, 5]), row) == [3, 4, 5, 6]  # all kept, plus the bonus
    assert verify(_logits(3, 4, 5, 6), Draft([3, 1, 5]), row) == [3, 4]  # the first miss ends it
    assert verify(_logits(2, 4), Draft([3]), row) == [2]
    assert row.output_counts == Counter()  # the engine counts emitted tokens itself


def test_greedy_verification_applies_penalties_to_accepted_tokens() -> None:
    logits = np.tile(np.array([[0.0, 3.0, 2.9, 0.0]], dtype=np.float32), (3, 1))
    row = _row(temperature=0.0, frequency_penalty=1.0)
    # plain decoding: 1 (no counts), then 2 (1 is penalized to 2.0), then 1 again (both penalized once)
    assert verify(logits, Draft([1, 2]), row) == [1, 2, 1]
    assert verify(logits, Draft([1, 1]), row) == [1, 2]


def test_rejection_sampling_with_a_point_mass_draft_matches_the_target() -> None:
    """P(emit x) = p(x) whatever token the draft proposes (here: the likeliest and a rare one)."""
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]], dtype=np.float32))
    for proposed in (0, 3):
        row = _row(temperature=1.0)
        counts = Counter(verify(logits, Draft([proposed]), row)[0] for _ in range(20_000))
        freq = np.array([counts[t] / 20_000 for t in range(4)])
        assert np.abs(freq - [0.5, 0.3, 0.15, 0.05]).max() < 0.015, (proposed, freq)


def test_rejection_sampling_with_a_draft_distribution_matches_the_target() -> None:
    logits = np.log(np.array([[0.6, 0.2, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25]], dtype=np.float32))
    q = (np.array([2, 0, 1]), np.array([0.7, 0.2, 0.1]))  # a draft that prefers token 2
    row, rng = _row(temperature=1.0), np.random.default_rng(1)
    counts: Counter[int] = Counter()
    for _ in range(20_000):
        proposed = int(rng.choice(q[0], p=q[1]))
        counts[verify(logits, Draft([proposed], [q]), row)[0]] += 1
    freq = np.array([counts[t] / 20_000 for t in range(4)])
    assert np.abs(freq - [0.6, 0.2, 0.1, 0.1]).max() < 0.015, freq


# -- the adaptive controller ---------------------------------------------------------------------------
def test_best_k_weighs_acceptance_against_measured_cost() -> None:
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    flat = [1.0 + 0.1 * k for k in range(7)]
    assert best_k(0.9, flat) == 6
    assert best_k(0.05, flat) == 0
    llama = [t / LLAMA_STEP_SECONDS[0] for t in LLAMA_STEP_SECONDS]
    assert best_k(0.9, llama) == 3  # 4-token chunks are the cheap ones
    assert best_k(0.5, llama) == 0


def test_adaptive_k_turns_off_and_probes_back() -> None:
    state = AdaptiveK(Ema(0.85, 0.6))
    costs = [1.0 + 0.3 * k for k in range(7)]
    for _ in range(10):
        state.observe(3, 0)
    ks = [state.next_k(costs, probe_every=4, probe_k=2) for _ in range(28)]
    assert [i for i, k in enumerate(ks) if k] == [3, 11, 27] and set(ks) == {0, 2}  # probes back off
    for _ in range(10):
        state.observe(3, 3)
    assert state.next_k(costs, 4, 2) >= 3


def test_cost_model_learns_step_times_by_tokens() -> None:
    cost = CostModel(prior=0.2)
    assert not cost.ready and cost.relative(3) == pytest.approx([1.0, 1.2, 1.4, 1.6])
    for _ in range(5):
        cost.on_step(0.010, rows=1, tokens=1)
        cost.on_step(0.025, rows=1, tokens=3)
    assert cost.ready and cost.relative(3) == pytest.approx([1.0, 1.2, 2.5, 2.7])  # unmeasured: previous + prior
    cost.on_step(2.0, rows=1, tokens=1)  # a stall (the host was busy) changes nothing
    assert cost.relative(3)[2] == pytest.approx(2.5)
    cost.on_propose(0.02, tokens=2)  # a draft model as slow as the target
    assert cost.relative(2) == pytest.approx([1.0, 2.2, 4.5])
    cost.on_step(0.5, rows=1, tokens=4)  # one sample is not a price yet
    assert cost.relative(3)[3] == pytest.approx(2.5 + 0.2 + 3.0)


def test_cost_model_prices_drafts_against_a_batched_row() -> None:
    cost = CostModel(prior=0.2)
    for _ in range(3):
        for tokens, seconds in ((4, 0.040), (5, 0.048), (6, 0.056)):
            cost.on_step(seconds, rows=4, tokens=tokens)
    cost.on_step(0.040, rows=4, tokens=4)  # the latest step: four plain rows, 10 ms each
    # each measured draft token costs 0.8 of a row; an unmeasured one a whole row when rows are batched
    assert cost.relative(3) == pytest.approx([1.0, 1.8, 2.6, 3.6])


def test_speedup_estimate_prices_each_draft_length() -> None:
    stats = SpecStats("ngram", decodes=10)
    stats.record(proposed=3, accepted=3)
    stats.record(proposed=1, accepted=0)
    # 8 plain decodes + a 3-draft step (cost 2) + a 1-draft step (cost 1.5) emit 10 + 3 tokens
    assert stats.speedup_estimate([1.0, 1.5, 1.8, 2.0]) == pytest.approx(13 / 11.5)


# -- the scheduler's room for drafts --------------------------------------------------------------------
def _decoding(seq_id: int, blocks: BlockManager, prompt_len: int = 7) -> Request:
    request = Request(f"r{seq_id}", seq_id, list(range(prompt_len)), SamplingParams())
    request.output = [1]
    request.num_computed = prompt_len
    blocks.allocate(seq_id, [], request.num_tokens, request.tokens)
    return request


def test_draft_room_within_budget_and_free_blocks_never_preempting() -> None:
    blocks = BlockManager(num_blocks=5, block_size=4)
    sched = Scheduler(SchedulerConfig(max_batch_tokens=6), blocks, draft_k=lambda r: 5)
    a, b = _decoding(0, blocks), _decoding(1, blocks)  # 2 blocks each: 1 block free
    sched.running = [a, b]
    out = sched.schedule()
    rooms = {s.request.seq_id: s.draft_room for s in out.items}
    assert rooms == {0: 4, 1: 0}  # a fills its free block (8 -> 12 positions); b finds none left
    assert not out.preempted and blocks.num_free == 0


def test_invariant_mode_drafts_only_for_a_lone_request_within_the_row_limit() -> None:
    blocks = BlockManager(num_blocks=20, block_size=4)
    sched = Scheduler(SchedulerConfig(batch_invariant=True, invariant_rows=7), blocks, draft_k=lambda r: 9)
    sched.running = [_decoding(0, blocks)]
    assert [s.draft_room for s in sched.schedule().items] == [6]
    sched.running.append(_decoding(1, blocks))
    assert [s.draft_room for s in sched.schedule().items] == [0, 0]


# -- options ---------------------------------------------------------------------------------------------
def test_parse_speculate() -> None:
    assert parse_speculate("off") == ("off", "")
    assert parse_speculate("ngram") == ("ngram", "")
    assert parse_speculate("draft:/m/small.gguf") == ("draft", "/m/small.gguf")
    assert parse_speculate("self:4") == ("self", "4")
    for bad in ("lookahead", "draft:", "self:x", "self:0", "ngram:3"):
        with pytest.raises(TwinferError, match="--speculate"):
            parse_speculate(bad)


def test_kept_layers_spread_the_skips_over_the_middle() -> None:
    assert kept_layers(2, 1) == [0]
    assert kept_layers(18, 6) == [0, 1, 3, 4, 6, 8, 9, 11, 12, 14, 16, 17]
    with pytest.raises(TwinferError, match="skip 1 to 16"):
        kept_layers(18, 17)
