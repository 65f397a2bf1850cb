"""Verification: which drafted tokens the target keeps, and the one token it adds.
Greedy rows keep a draft token while it is the target's own choice (exact). Sampled rows use
speculative rejection sampling (Leviathan et al. 2023): every emitted token is distributed as the
target's sampler would draw it (docs/internals.md, "Speculative decoding")."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import numpy as np

from twinfer.runtime.engine.sampler import RowState, apply_penalties, draw, filtered, is_greedy
from twinfer.runtime.speculative.proposer import Dist, Draft


def verify(logits: np.ndarray, draft: Draft, row: RowState) -> list[int]:
    """Tokens to emit (1 to len(draft)+1): the accepted draft prefix, then the target's token. `logits`
    are [len(draft.tokens) + 1, V]; draws use `row.rng`; `row` is not changed."""
    state = replace(row, output_counts=Counter(row.output_counts))
    out: list[int] = []
    for i, proposed in enumerate(draft.tokens):
        token = _decide(logits[i], proposed, None if draft.dists is None else draft.dists[i], state)
        out.append(token)
        state.output_counts[token] += 1
        if token != proposed:
            return out
    out.append(_target_token(logits[len(draft.tokens)], state))
    return out


def _penalized(logits: np.ndarray, row: RowState) -> np.ndarray:
    return apply_penalties(logits, row) if row.params.penalized else logits


def _target_token(logits: np.ndarray, row: RowState) -> int:
    """What the plain sampler would emit from this row."""
    x = _penalized(logits, row)
    if is_greedy(row):
        return int(np.argmax(x))
    return draw(*filtered(x, row), row.rng)


def _decide(logits: np.ndarray, proposed: int, q: Dist | None, row: RowState) -> int:
    """`proposed` if the target keeps it, else the target's replacement."""
    x = _penalized(logits, row)
    if is_greedy(row):
        return int(np.argmax(x))
    cand, p = filtered(x, row)
    p_d = float(p[cand == proposed].sum())
    q_d = 1.0 if q is None else float(q[1][q[0] == proposed].sum())
    if q_d > 0.0 and row.rng.random() < min(1.0, p_d / q_d):
        return proposed
    residual = _residual(cand, p, proposed, q)
    return draw(cand, residual, row.rng) if residual is not None else draw(cand, p, row.rng)


def _residual(cand: np.ndarray, p: np.ndarray, proposed: int, q: Dist | None) -> np.ndarray | None:
    """max(p - q, 0) over the target's candidates, normalized; None if it vanishes (p == q)."""
    r = p.copy()
    if q is None:
        r[cand == proposed] = 0.0
    else:
        q_on_cand = np.zeros_like(p)
        order = np.argsort(cand)
        pos = np.searchsorted(cand, q[0], sorter=order)
        pos = np.minimum(pos, len(cand) - 1)
        hit = cand[order[pos]] == q[0]
        q_on_cand[order[pos[hit]]] = q[1][hit]
        r = np.maximum(r - q_on_cand, 0.0)
    total = r.sum()
    return r / total if total > 0.0 else None
