"""The sampler's shortcuts (the head, and block sums over a flat row) draw from exactly the distribution
`filtered` describes."""

from __future__ import annotations

import numpy as np
import pytest

import twinfer.runtime.engine.sampler as sampler
from twinfer.runtime.engine.params import SamplingParams
from twinfer.runtime.engine.sampler import RowState, filtered, sample_row

DRAWS = 30_000
CASES = [
    dict(temperature=1.0),
    dict(temperature=0.7),
    dict(temperature=1.0, top_p=0.9),
    dict(temperature=1.3, top_k=5),
    dict(temperature=1.0, min_p=0.2),
    dict(temperature=0.8, top_k=6, top_p=0.95, min_p=0.05),
]


def _frequencies(logits: np.ndarray, params: SamplingParams, seed: int) -> np.ndarray:
    row = RowState(params, np.random.default_rng(seed), [])
    counts = np.bincount([sample_row(logits, row) for _ in range(DRAWS)], minlength=logits.shape[0])
    return counts / DRAWS


@pytest.mark.parametrize("flat", [False, True], ids=["head", "blocks"])
@pytest.mark.parametrize("kw", CASES, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_draws_match_the_full_distribution(monkeypatch: pytest.MonkeyPatch, kw: dict, flat: bool) -> None:
    # a head of ~1.5 nats leaves most of the mass in the "tail": every branch, the rare one included, is drawn;
    # blocks of 4 tokens put the draw across blocks and inside the short last one
    monkeypatch.setattr(sampler, "HEAD_NATS", 1.5)
    monkeypatch.setattr(sampler, "BLOCK", 4)
    monkeypatch.setattr(sampler, "_flat", lambda logits, cut: flat)
    logits = np.array([3.0, 2.6, 2.2, 1.9, 1.0, 0.4, -0.3, -1.0, -2.5, 0.9], dtype=np.float32)
    params = SamplingParams(**kw)
    cand, probs = filtered(logits, RowState(params, np.random.default_rng(0), []))
    exact = np.zeros(logits.shape[0])
    exact[cand] = probs
    seen = _frequencies(logits, params, seed=7)
    sigma = np.sqrt(exact * (1 - exact) / DRAWS)
    assert np.all(np.abs(seen - exact) <= 5 * sigma + 1e-12), (seen, exact)
    assert np.all(seen[exact == 0] == 0)


def test_head_is_used_on_a_real_vocabulary_and_falls_back_only_when_needed() -> None:
    rng = np.random.default_rng(3)
    logits = rng.normal(-20, 4, 262_144).astype(np.float32)
    logits[:50] = rng.normal(10, 2, 50)
    row = RowState(SamplingParams(temperature=1.0), np.random.default_rng(1), [])
    tokens = [sample_row(logits, row) for _ in range(2_000)]
    assert max(tokens) < 50  # the tail's 262k tokens together weigh < 1e-6 here
    greedy = RowState(SamplingParams(temperature=0.0), np.random.default_rng(1), [])
    assert sample_row(logits, greedy) == int(np.argmax(logits))
