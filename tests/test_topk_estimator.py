"""The top-k KL estimators of quant/topk_kl.py on synthetic distributions with a known exact KL.

The tail bucket must never exceed the exact KL (the log-sum inequality); the censored tail model must
recover what the bucket misses when the candidate's log-ratio is Gaussian noise, stay exact when
nothing is truncated, read an identical candidate as zero, and fit the noise free of the bias the
tokens that made the candidate's top k carry.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from twinfer.quant.kl import KLReport, kl_rows, log_softmax
from twinfer.quant.remote import RemoteKLReport
from twinfer.quant.topk_kl import (
    censored_normal_fit,
    log_ndtr,
    topk_estimate_rows,
    truncate_top_k,
)

V, ROWS = 4000, 48


def zipf_logits(rng: np.random.Generator, rows: int = ROWS, vocab: int = V) -> np.ndarray:
    """Reference logits whose probabilities fall off like a language model's (Zipf, shuffled ranks)."""
    base = -1.1 * np.log(np.arange(1, vocab + 1))
    return np.stack([rng.permutation(base) + rng.normal(0, 0.3, vocab) for _ in range(rows)])


def test_log_ndtr_matches_erfc_including_the_far_tail() -> None:
    x = np.array([-38.0, -20.0, -8.0, -3.0, -1.0, 0.0, 0.5, 2.0, 6.0, 9.0])
    want = np.array([math.log(0.5 * math.erfc(-v / math.sqrt(2))) if v > -25 else
                     -v * v / 2 - math.log(-v * math.sqrt(2 * math.pi)) - 1 / (v * v) for v in x])
    np.testing.assert_allclose(log_ndtr(x), want, rtol=2e-7, atol=1e-12)


def test_censored_fit_recovers_sigma_that_the_seen_values_underestimate() -> None:
    rng = np.random.default_rng(0)
    d = rng.normal(-0.5, 1.3, 8000)
    bounds = rng.uniform(-2.5, 2.5, 8000)  # each value is seen only above its own bound
    seen, hidden = d[d >= bounds], bounds[d < bounds]
    mu, sigma = censored_normal_fit(seen, hidden)
    assert seen.std() < 1.15  # the selection: only high values were seen, with a narrower spread
    assert mu == pytest.approx(-0.5, abs=0.06) and sigma == pytest.approx(1.3, rel=0.04)


def test_bucket_is_a_lower_bound_and_the_tail_model_closes_the_gap() -> None:
    rng = np.random.default_rng(1)
    p = zipf_logits(rng)
    q = p + rng.normal(0, 1.2, p.shape)  # a degraded candidate: log-normal noise on every token
    exact = kl_rows(p, q)
    for k in (5, 10, 20):
        rows = topk_estimate_rows(p, truncate_top_k(q, k))
        assert np.all(rows.bucket <= exact + 1e-12)
        assert rows.bucket.mean() < 0.8 * exact.mean()  # the bucket misses the divergence inside the tail
        assert abs(rows.estimate.mean() - exact.mean()) <= 0.1 * exact.mean(), (k, rows.estimate.mean(), exact.mean())
        assert np.all(rows.estimate >= rows.bucket)


def test_mild_noise_is_not_overshot() -> None:
    rng = np.random.default_rng(2)
    p = zipf_logits(rng)
    q = p + rng.normal(0, 0.15, p.shape)  # a Q8_0-like candidate
    exact = kl_rows(p, q).mean()
    rows = topk_estimate_rows(p, truncate_top_k(q, 20))
    assert exact * 0.85 <= rows.estimate.mean() <= exact * 1.1


def test_identical_candidate_reads_zero_and_untruncated_is_exact() -> None:
    rng = np.random.default_rng(3)
    p = zipf_logits(rng, rows=8, vocab=300)
    same = topk_estimate_rows(p, truncate_top_k(p, 20))
    assert same.estimate.max() <= 1e-12 and same.bucket.max() <= 1e-12
    q = p + rng.normal(0, 1.0, p.shape)
    full = topk_estimate_rows(p, truncate_top_k(q, 300))  # the whole vocabulary: nothing in the tail
    np.testing.assert_allclose(full.estimate, kl_rows(p, q), rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(full.bucket, kl_rows(p, q), rtol=1e-9, atol=1e-12)
    assert np.all(full.ref_tail <= 1e-12)


def test_rows_too_sparse_to_fit_take_the_other_rows_sigma() -> None:
    rng = np.random.default_rng(4)
    p = zipf_logits(rng, rows=6, vocab=2000)
    q = p + rng.normal(0, 1.0, p.shape)
    top = truncate_top_k(q, 10)
    top[0] = [((int(np.argmin(p[0])),), float(log_softmax(q)[0].max()))]  # one entry, outside the reference's head
    rows = topk_estimate_rows(p, top)
    assert rows.sigma[0] == pytest.approx(float(np.sqrt(np.mean(rows.sigma[1:] ** 2))))
    with pytest.raises(ValueError, match="6 reference rows but 5 candidate rows"):
        topk_estimate_rows(p, top[:5])


def test_report_names_the_estimator_and_prints_the_bound_beside_it() -> None:
    def kl(mean: float) -> KLReport:
        return KLReport("llamacpp", "http://h/v1", "prose", mean, mean, mean, mean, 0.9, 32)

    r = RemoteKLReport(kl(0.52), "http://h/v1", "q2", None, 1.0, "token-by-token", 20, "/tokenize", 0.2, kl(0.30), 1.1)
    text = "\n".join(r.lines())
    assert "censored log-normal tail model" in text and "lower bound (top-k + tail bucket" in text
    assert "3.00e-01" in text and text.splitlines()[-1].strip().startswith("FLAGGED: mean KL 5.20e-01")
    d = r.as_dict()
    assert d["mean_kl"] == 0.52 and d["bound"]["mean_kl"] == 0.30 and d["faithful"] is False
    assert d["estimator"].startswith("top-k + censored") and d["bound"]["estimator"].startswith("top-k + tail bucket")


def test_probes_are_exact_terms_that_tighten_the_bound() -> None:
    rng = np.random.default_rng(5)
    p = zipf_logits(rng)
    q = p + rng.normal(0, 1.2, p.shape)
    lq, exact = log_softmax(q), kl_rows(p, q)
    top = truncate_top_k(q, 5)
    probes = []
    for r, row in enumerate(top):
        have = {i for ids, _ in row for i in ids}
        probes.append([(int(t), float(lq[r, t])) for t in np.argsort(-p[r])[:20] if int(t) not in have][:8])
    plain, probed = topk_estimate_rows(p, top, 5), topk_estimate_rows(p, top, 5, probes)
    assert np.all(probed.bucket <= exact + 1e-12) and probed.bucket.mean() > plain.bucket.mean()
    assert abs(probed.estimate.mean() - exact.mean()) <= 0.1 * exact.mean()
    assert np.all(probed.ref_tail < plain.ref_tail)


# -- logit_bias probes against stub endpoints ------------------------------------------------------

def probe_stub(kind: str, lq: np.ndarray) -> tuple[Any, list[int]]:
    """A stub completions endpoint over one candidate distribution `lq` [vocab]: it honours logit_bias and
    returns raw logprobs ("raw"), the biased distribution's ("biased"), or ignores the bias ("refused")."""
    from test_eval_remote import Stub, _completion, _models

    from twinfer.runtime.tokenizer import load_tokenizer

    tok = load_tokenizer(None)
    calls: list[int] = []

    def complete(body: dict[str, Any]) -> tuple[int, dict[str, Any], dict[str, str]]:
        bias = {int(t): float(b) for t, b in (body.get("logit_bias") or {}).items()}
        calls.append(len(bias))
        shown = lq.copy()
        if kind == "biased":
            for t, b in bias.items():
                shown[t] += b
            shown = log_softmax(shown)
        chosen = int(np.argmax(shown if kind == "refused" else lq + np.bincount(
            list(bias), list(bias.values()), minlength=lq.size)))
        top = {tok.decode([int(i)]): float(shown[i]) for i in np.argsort(-shown)[: body["logprobs"]]}
        return 200, _completion({"tokens": [tok.decode([chosen])], "token_logprobs": [float(shown[chosen])],
                                 "top_logprobs": [top], "text_offset": [0]}), {}

    return Stub({"/v1/models": _models, "/v1/completions": complete}), calls


@pytest.mark.parametrize("kind", ["raw", "biased", "refused"])
def test_logit_bias_probe_recovers_the_raw_logprob(kind: str) -> None:
    pytest.importorskip("openai")
    from twinfer.quant.remote import Endpoint, PieceIndex
    from twinfer.runtime.tokenizer import load_tokenizer

    tok = load_tokenizer(None)
    pieces = PieceIndex(tok)
    lq = log_softmax(np.random.default_rng(6).normal(0, 2.0, tok.vocab_size))
    unique = [i for i in np.argsort(-lq)[:400].tolist() if len(pieces.ids.get(tok.decode([i]), [])) == 1]
    best = (pieces.ids[tok.decode([unique[0]])], float(lq[unique[0]]))  # the unbiased top-1
    target = unique[-1]  # far outside the top 20
    stub, calls = probe_stub(kind, lq)
    try:
        got = Endpoint(stub.url).probe([2, 100], target, 20, best, pieces)
    finally:
        stub.close()
    assert calls == [1]
    if kind == "refused":
        assert got is None
        return
    assert got == pytest.approx(float(lq[target]), abs=1e-6)


def test_biased_inversion_is_the_single_token_formula() -> None:
    """For one token biased by b, log q = lq' - b + (l1 - l1') equals q = q' / (e^b - q' (e^b - 1))."""
    q, b = 3e-4, 5.0
    z = 1 - q + q * math.exp(b)
    q_biased, top1, top1_biased = q * math.exp(b) / z, 0.4, 0.4 / z
    ratio = math.log(q_biased) - b + math.log(top1) - math.log(top1_biased)
    single = q_biased / (math.exp(b) - q_biased * (math.exp(b) - 1))
    assert math.exp(ratio) == pytest.approx(q, rel=1e-12) and single == pytest.approx(q, rel=1e-12)
