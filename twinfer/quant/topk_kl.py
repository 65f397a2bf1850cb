"""KL against a distribution known only by its top k: what an OpenAI-compatible endpoint returns.
Two estimates of KL(p || q): the tail bucket (a lower bound: the rest of the vocabulary as one outcome)
and, by default, that bound plus `p_tail * sigma^2 / 2` from a censored (Tobit) Gaussian fit of the
log-ratios. Exact when nothing is truncated, zero for an identical candidate (docs/quantization.md,
"Layouts")."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from twinfer.quant.kl import log_softmax

# A candidate row: (reference token ids that share one piece, candidate logprob), best first.
TopRow = Sequence[tuple[Sequence[int], float]]

TAIL_TOKENS = 1000  # the reference's most likely tokens the noise model is fitted on (seen or censored)
SIGMA_RANGE = (1e-8, 10.0)  # the fit's bounds on sigma, in nats
ESTIMATOR = "top-k + censored log-normal tail model"
BOUND = "top-k + tail bucket (a lower bound on the exact KL)"


def truncate_top_k(logits: np.ndarray, k: int) -> list[list[tuple[tuple[int], float]]]:
    """The top-k rows an endpoint would return for `logits` [rows, vocab] (one id per entry)."""
    lq = log_softmax(logits)
    part = np.argpartition(-lq, k - 1, axis=-1)[:, :k]
    top = np.take_along_axis(part, np.argsort(-np.take_along_axis(lq, part, axis=-1), axis=-1), axis=-1)
    return [[((int(i),), float(lq[r, i])) for i in top[r]] for r in range(lq.shape[0])]


def log_ndtr(x: np.ndarray) -> np.ndarray:
    """log Phi(x), the standard normal CDF, stable for very negative x (erfc's Chebyshev fit, rel. error < 1.2e-7)."""
    z = -np.asarray(x, dtype=np.float64) / np.sqrt(2.0)  # Phi(x) = erfc(z) / 2
    a = np.abs(z)
    t = 1.0 / (1.0 + 0.5 * a)
    poly = -1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (-0.18628806 + t * (
        0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277))))))))
    log_erfc_a = np.log(t) - a * a + poly  # log erfc(|z|)
    out = np.where(z >= 0, log_erfc_a, np.log1p(-0.5 * np.exp(log_erfc_a)) + np.log(2.0))
    return out - np.log(2.0)


def censored_normal_fit(seen: np.ndarray, bounds: np.ndarray) -> tuple[float, float]:
    """Maximum-likelihood (mu, sigma) of N(mu, sigma^2) from values `seen` and values known only to lie
    below `bounds` (a Tobit model), by a zooming grid over (mu, log sigma) within `SIGMA_RANGE`."""
    mu0 = float(seen.mean()) if seen.size else float(bounds.min()) if bounds.size else 0.0
    mu_lo, mu_hi = mu0 - 6.0, mu0 + 6.0
    ls_lo, ls_hi = np.log(SIGMA_RANGE[0]), np.log(SIGMA_RANGE[1])
    best_mu, best_ls = mu0, 0.0
    for _ in range(10):
        mu = np.linspace(mu_lo, mu_hi, 9)[:, None, None]
        ls = np.linspace(ls_lo, ls_hi, 9)[None, :, None]
        s = np.exp(ls)
        nll = (0.5 * (((seen - mu) / s) ** 2).sum(-1) + seen.size * ls[..., 0]
               - log_ndtr((bounds - mu) / s).sum(-1))  # [9, 9]
        g, h = np.unravel_index(int(np.argmin(nll)), nll.shape)
        best_mu, best_ls = float(mu[g, 0, 0]), float(ls[0, h, 0])
        dmu, dls = (mu_hi - mu_lo) / 4, (ls_hi - ls_lo) / 4
        mu_lo, mu_hi = best_mu - dmu, best_mu + dmu
        ls_lo, ls_hi = max(best_ls - dls, np.log(SIGMA_RANGE[0])), min(best_ls + dls, np.log(SIGMA_RANGE[1]))
    return best_mu, float(np.exp(best_ls))


@dataclass(frozen=True)
class TopKRows:
    """Per scored row: both estimates of KL(ref || cand), top-1 agreement, the candidate's tail mass
    q_tail, the reference's mass outside S (p_tail) and the fitted sigma of the log-ratio."""

    estimate: np.ndarray
    bucket: np.ndarray
    agree: np.ndarray
    tail: np.ndarray
    ref_tail: np.ndarray
    sigma: np.ndarray


def topk_estimate_rows(ref_logits: np.ndarray, cand_top: Sequence[TopRow], k: int | None = None,
                       probes: Sequence[Sequence[tuple[int, float]]] | None = None) -> TopKRows:
    """Both estimates for rows of reference logits [rows, vocab] and the candidate's top-k rows; `k` is
    the number asked for (the fit's censoring bound), `probes` extra (token, logprob) pairs per row."""
    lp = log_softmax(ref_logits)
    if lp.shape[0] != len(cand_top):
        raise ValueError(f"{lp.shape[0]} reference rows but {len(cand_top)} candidate rows")
    n = len(cand_top)
    bucket, tail, ref_tail, sigma = np.zeros(n), np.zeros(n), np.zeros(n), np.full(n, np.nan)
    agree = np.zeros(n, dtype=bool)
    ref_best = np.argmax(lp, axis=-1)
    m = min(TAIL_TOKENS, lp.shape[1])
    ranked = np.argpartition(-lp, m - 1, axis=-1)[:, :m]
    for r, row in enumerate(cand_top):
        total_p = total_q = 0.0
        seen_ids: dict[int, float] = {}  # reference id in the k best entries or probed -> d of its entry
        ranked_row = sorted(row, key=lambda e: -e[1])
        fit_size = min(k or len(row), len(row))
        known = {int(i) for ids, _ in row for i in ids}
        extra = [((t,), lq) for t, lq in (probes[r] if probes else ()) if t not in known]
        for j, (ids, lq) in enumerate([*ranked_row, *extra]):
            p = float(np.exp(lp[r, list(ids)]).sum()) if len(ids) else 0.0
            total_p, total_q = total_p + p, total_q + float(np.exp(lq))
            if p > 0:
                bucket[r] += p * (np.log(p) - lq)
                if j < fit_size or j >= len(row):
                    seen_ids.update((int(i), lq - np.log(p)) for i in ids)
        p_tail, q_tail = max(1.0 - total_p, 0.0), max(1.0 - total_q, 1e-30)
        if p_tail > 0:
            bucket[r] += p_tail * (np.log(p_tail) - np.log(q_tail))
        if row:
            best = max(row, key=lambda e: e[1])
            agree[r] = int(ref_best[r]) in best[0]
            top = ranked[r].tolist()
            seen = np.array([seen_ids[i] for i in top if i in seen_ids])
            if seen.size >= 2:  # fewer leaves the fit unbounded; such rows take the others' sigma
                q_min = ranked_row[fit_size - 1][1]
                bounds = np.array([q_min - lp[r, i] for i in top if i not in seen_ids])
                sigma[r] = censored_normal_fit(seen, bounds)[1]
        tail[r], ref_tail[r] = max(1.0 - total_q, 0.0), p_tail
    fitted = sigma[np.isfinite(sigma)]
    sigma = np.where(np.isfinite(sigma), sigma, float(np.sqrt(np.mean(fitted**2))) if fitted.size else 0.0)
    bucket = np.maximum(bucket, 0.0)
    return TopKRows(bucket + ref_tail * sigma**2 / 2, bucket, agree, tail, ref_tail, sigma)

