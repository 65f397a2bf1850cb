"""KL against a distribution known only by its top k: what an OpenAI-compatible endpoint returns.

An endpoint's `logprobs` give the candidate's k most likely tokens. The estimate keeps those k
tokens and lumps the rest of the vocabulary into one tail bucket on both sides:

    KL_k = sum_{i in S} p_i log(p_i / q_i) + p_tail log(p_tail / q_tail),   S = candidate's top k

where p is the reference's full distribution. Merging outcomes never increases KL (the log-sum
inequality), so KL_k <= KL exactly: the estimator is biased low, and the divergence it misses is
the one inside the tail. `bench/topk_kl_error.py` measures the gap against the exact KL of two local
runners truncated the same way (docs/quantization.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from twinfer.quant.kl import log_softmax

# A candidate row: (reference token ids that share one piece, candidate logprob), best first.
TopRow = Sequence[tuple[Sequence[int], float]]


def truncate_top_k(logits: np.ndarray, k: int) -> list[list[tuple[tuple[int], float]]]:
    """The top-k rows an endpoint would return for `logits` [rows, vocab] (one id per entry)."""
    lq = log_softmax(logits)
    part = np.argpartition(-lq, k - 1, axis=-1)[:, :k]
    top = np.take_along_axis(part, np.argsort(-np.take_along_axis(lq, part, axis=-1), axis=-1), axis=-1)
    return [[((int(i),), float(lq[r, i])) for i in top[r]] for r in range(lq.shape[0])]


def topk_kl_rows(ref_logits: np.ndarray, cand_top: Sequence[TopRow]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row: (KL_k(ref || cand), top-1 agreement, the candidate's tail mass q_tail)."""
    lp = log_softmax(ref_logits)
    if lp.shape[0] != len(cand_top):
        raise ValueError(f"{lp.shape[0]} reference rows but {len(cand_top)} candidate rows")
    kl = np.zeros(len(cand_top))
    agree = np.zeros(len(cand_top), dtype=bool)
    tail = np.zeros(len(cand_top))
    ref_best = np.argmax(lp, axis=-1)
    for r, row in enumerate(cand_top):
        total_p = total_q = 0.0
        for ids, lq in row:
            p = float(np.exp(lp[r, list(ids)]).sum()) if len(ids) else 0.0
            q = float(np.exp(lq))
            total_p, total_q = total_p + p, total_q + q
            if p > 0:
                kl[r] += p * (np.log(p) - lq)
        p_tail, q_tail = max(1.0 - total_p, 0.0), max(1.0 - total_q, 1e-30)
        if p_tail > 0:
            kl[r] += p_tail * (np.log(p_tail) - np.log(q_tail))
        if row:
            best = max(row, key=lambda e: e[1])
            agree[r] = int(ref_best[r]) in best[0]
        tail[r] = max(1.0 - total_q, 0.0)
    return np.maximum(kl, 0.0), agree, tail
