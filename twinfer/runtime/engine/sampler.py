"""Turning logits into tokens: logit bias, grammar masks, penalties, temperature, top-k, top-p, min-p,
seeds and logprobs. Each request owns a seeded Generator, so its samples do not depend on its batch;
logprobs are always those of the raw model distribution."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from twinfer.runtime.constraints.mask import Guide, draft_masks, row_masks, timed_apply
from twinfer.runtime.engine.params import SamplingParams


@dataclass
class RowState:
    """What the sampler needs to know about one request."""

    params: SamplingParams
    rng: np.random.Generator
    prompt_tokens: list[int]
    output_counts: Counter[int] = field(default_factory=Counter)
    temperature: float | None = None  # overrides params.temperature (the guard's retries)
    guide: Guide | None = None  # the request's grammar, when it has a constraint


@dataclass
class Sampled:
    token: int
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None  # (token, logprob) best first
    rank: int | None = None  # 1 + how many tokens are more likely (prompt logprobs only)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64, copy=False)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def apply_penalties(logits: np.ndarray, row: RowState) -> np.ndarray:
    """HF-style repetition penalty (prompt and output) plus OpenAI presence/frequency penalties."""
    p = row.params
    if p.repetition_penalty == 1.0 and not (row.output_counts and (p.presence_penalty or p.frequency_penalty)):
        return logits
    out = logits.astype(np.float32, copy=True)
    if p.repetition_penalty != 1.0:
        seen = np.fromiter(set(row.prompt_tokens) | set(row.output_counts), dtype=np.int64)
        vals = out[seen]
        out[seen] = np.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if row.output_counts and (p.presence_penalty or p.frequency_penalty):
        ids = np.fromiter(row.output_counts.keys(), dtype=np.int64)
        counts = np.fromiter(row.output_counts.values(), dtype=np.float32)
        out[ids] -= p.presence_penalty + p.frequency_penalty * counts
    return out


def is_greedy(row: RowState) -> bool:
    """Whether the row picks the most likely token (temperature below 1e-5)."""
    return (row.params.temperature if row.temperature is None else row.temperature) < 1e-5


def filtered(logits: np.ndarray, row: RowState) -> tuple[np.ndarray, np.ndarray]:
    """The distribution a sampled row draws from: candidate ids and their probabilities after
    temperature, top-k, min-p and top-p. `logits` are already penalized. Candidates are sorted
    (most likely first) only when top-p needs the order: a full sort of a 262k vocabulary costs
    more than the rest of the step."""
    p = row.params
    temperature = p.temperature if row.temperature is None else row.temperature
    if 0 < p.top_k < logits.shape[0]:
        cand = np.argpartition(-logits, p.top_k - 1)[: p.top_k]
    else:
        cand = np.arange(logits.shape[0])
    scaled = logits[cand].astype(np.float64) / temperature
    if p.top_p < 1.0:
        order = np.argsort(-scaled, kind="stable")
        cand, scaled = cand[order], scaled[order]
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    if p.top_p < 1.0:  # sorted: both cuts keep a prefix
        n = int(np.searchsorted(np.cumsum(probs), p.top_p)) + 1
        if p.min_p > 0.0:
            n = min(n, int(np.count_nonzero(probs >= p.min_p * probs[0])))
        cand, probs = cand[:n], probs[:n]
    elif p.min_p > 0.0:
        keep = probs >= p.min_p * probs.max()
        cand, probs = cand[keep], probs[keep]
    return cand, probs / probs.sum()


def draw(cand: np.ndarray, probs: np.ndarray, rng: np.random.Generator) -> int:
    """One id from a candidate distribution, with one uniform from `rng`."""
    index = int(np.searchsorted(np.cumsum(probs), rng.random(), side="right"))
    return int(cand[min(index, len(cand) - 1)])


def sample_row(logits: np.ndarray, row: RowState) -> int:
    """One token from one row of (penalized) logits, using the row's own generator."""
    if is_greedy(row):  # dividing by a vanishing temperature overflows; it is greedy anyway
        return int(np.argmax(logits))
    p = row.params
    if p.top_k == 0 and p.top_p >= 1.0 and p.min_p == 0.0:
        best = float(logits.max())
        if _flat(logits, best - HEAD_NATS * _temperature(row)):
            return _sample_blocks(logits, best, row)
    token = _sample_head(logits, row)
    return token if token is not None else draw(*filtered(logits, row), row.rng)


BLOCK = 1024  # a full-vocabulary draw finds its block from block sums, then its token inside the block


def _temperature(row: RowState) -> float:
    return row.params.temperature if row.temperature is None else row.temperature


def _flat(logits: np.ndarray, cut: float) -> bool:
    """Whether a sixteenth of the vocabulary or more is at least `cut` (judged from every 64th token)."""
    return int(np.count_nonzero(logits[::64] >= cut)) * 64 * 16 >= logits.shape[0]


def _sample_blocks(logits: np.ndarray, best: float, row: RowState) -> int:
    """A draw from the whole vocabulary in one pass: float32 weights, float64 sums."""
    weights = np.subtract(logits, best, dtype=np.float32)
    if _temperature(row) != 1.0:
        weights *= np.float32(1.0 / _temperature(row))
    np.exp(weights, out=weights)
    whole = weights.shape[0] - weights.shape[0] % BLOCK
    sums = np.append(weights[:whole].reshape(-1, BLOCK).sum(axis=1, dtype=np.float64),
                     weights[whole:].sum(dtype=np.float64))
    cum = np.cumsum(sums)
    u = row.rng.random() * float(cum[-1])
    b = min(int(np.searchsorted(cum, u, side="right")), cum.shape[0] - 1)
    segment = weights[b * BLOCK : (b + 1) * BLOCK]
    inside = u - (float(cum[b - 1]) if b else 0.0)
    i = int(np.searchsorted(np.cumsum(segment, dtype=np.float64), inside, side="right"))
    return b * BLOCK + min(i, segment.shape[0] - 1)


# Tokens more than this many temperatures below the best logit weigh < e^-20 each against the best's 1.
HEAD_NATS = 20.0


def _sample_head(logits: np.ndarray, row: RowState) -> int | None:
    """`filtered` then `draw`'s distribution over the head only (docs/architecture.md, "One engine
    step"); None where only the tail could decide."""
    p = row.params
    temperature = _temperature(row)
    best = float(logits.max())
    if not np.isfinite(best):
        return None
    head = np.flatnonzero(logits >= best - HEAD_NATS * temperature)
    tail = logits.shape[0] - head.size
    if 0 < p.top_k < logits.shape[0]:
        if p.top_k > head.size:
            return None
        head = head[np.argpartition(-logits[head], p.top_k - 1)[: p.top_k]]
        tail = 0  # the k best are all in the head; filtered normalizes over them alone
    if p.top_p < 1.0:
        head = head[np.argsort(-logits[head], kind="stable")]
    weights = np.exp((logits[head].astype(np.float64) - best) / temperature)
    total, bound = float(weights.sum()), tail * float(np.exp(-HEAD_NATS))
    if p.top_p < 1.0:
        cum = np.cumsum(weights)
        n = int(np.searchsorted(cum / total, p.top_p)) + 1
        if bound and (n > head.size or int(np.searchsorted(cum / (total + bound), p.top_p)) + 1 != n):
            return None  # the nucleus' edge depends on the tail's exact weight
        head, weights, tail = head[:n], weights[:n], 0
    if p.min_p > 0.0:
        if tail and p.min_p < np.exp(-HEAD_NATS):
            return None
        keep = weights >= p.min_p * weights.max()
        head, weights, tail = head[keep], weights[keep], 0
    u = row.rng.random() * (float(weights.sum()) + (bound if tail else 0.0))
    cum = np.cumsum(weights)
    if u < cum[-1]:
        return int(head[min(int(np.searchsorted(cum, u, side="right")), head.size - 1)])
    return _draw_remainder(logits, row, head, weights, bound, temperature, best)


def _draw_remainder(logits: np.ndarray, row: RowState, head: np.ndarray, weights: np.ndarray, bound: float,
                    temperature: float, best: float) -> int:
    """The rare branch: head tokens weigh w (B - T) / (H + B), tail ones their own, so each token's
    overall chance is w / (H + T) (T: the tail's exact weight)."""
    full = np.exp((logits.astype(np.float64) - best) / temperature)
    in_head = np.zeros(full.shape[0], dtype=bool)
    in_head[head] = True
    head_total = float(weights.sum())
    tail_total = float(full[~in_head].sum())
    full[in_head] *= max(bound - tail_total, 0.0) / (head_total + bound)
    return draw(np.arange(full.shape[0]), full / full.sum(), row.rng)


def with_logprobs(token: int, logits: np.ndarray, top: int | None) -> Sampled:
    """`token` with its logprob under the raw model distribution and the `top` most likely ids."""
    result = Sampled(token)
    if top is not None:
        lp = log_softmax(logits)
        result.logprob = float(lp[token])
        if top:
            best = np.argpartition(-lp, top - 1)[:top]
            best = best[np.argsort(-lp[best], kind="stable")]
            result.top = [(int(t), float(lp[t])) for t in best]
    return result


def prompt_logprobs(logits: np.ndarray, targets: Sequence[int], top: int) -> list[Sampled]:
    """Each row's next prompt token (`targets[i]` follows row i) with `with_logprobs`'s logprob and `top`
    most likely ids, and its rank; one row at a time (a 262k-vocabulary row is 2 MB in float64)."""
    out = []
    for row, token in zip(logits, targets, strict=True):
        result = with_logprobs(int(token), row, top)
        result.rank = int(np.count_nonzero(row > row[token])) + 1
        out.append(result)
    return out


def add_bias(logits: np.ndarray, params: SamplingParams) -> None:
    """OpenAI's logit_bias, in place: -100 bans a token outright, other values are added."""
    ids = np.fromiter((t for t, _ in params.logit_bias), dtype=np.int64)
    bias = np.fromiter((b for _, b in params.logit_bias), dtype=np.float32)
    keep = ids < logits.shape[-1]
    ids, bias = ids[keep], bias[keep]
    logits[ids] = np.where(bias <= -100.0, -np.inf, logits[ids] + bias)


def sample(logits: np.ndarray, rows: list[RowState]) -> list[Sampled]:
    """Sample one token per row of logits [R, V]; logit_bias and grammar masks apply, logprobs are
    of the raw model distribution. Constrained rows' matchers advance over the sampled token."""
    guided = [(i, r.guide) for i, r in enumerate(rows) if r.guide is not None]
    masks = dict(zip([i for i, _ in guided], row_masks([g for _, g in guided], logits.shape[-1]), strict=True)
                 ) if guided else {}
    plain = [is_greedy(r) and not r.params.penalized and not r.params.logit_bias and r.guide is None for r in rows]
    greedy_ids = logits.argmax(axis=-1) if all(plain) else None  # one call for an all-greedy batch
    out: list[Sampled] = []
    for i, row in enumerate(rows):
        x = logits[i]
        if row.params.logit_bias:
            x = x.astype(np.float32, copy=True)
            add_bias(x, row.params)
        mask = masks.get(i)
        if is_greedy(row) and not row.params.penalized:
            if mask is not None:
                token = mask.argmax(x)
            else:
                token = int(greedy_ids[i]) if greedy_ids is not None else int(np.argmax(x))
        else:
            if mask is not None and row.guide is not None:
                x = timed_apply(row.guide, mask, x)
            token = sample_row(apply_penalties(x, row), row)
        out.append(with_logprobs(token, logits[i], row.params.logprobs))
        if row.guide is not None:
            row.guide.advance([token])
    return out


def draft_rows(logits: np.ndarray, row: RowState, draft: Sequence[int]) -> np.ndarray:
    """The verifier's rows [len(draft) + 1, V] for a drafted decode, biased and masked per position."""
    if row.guide is None and not row.params.logit_bias:
        return logits
    out = logits.astype(np.float32, copy=True)
    if row.params.logit_bias:
        for r in out:
            add_bias(r, row.params)
    if row.guide is not None:
        for i, mask in enumerate(draft_masks(row.guide, draft, logits.shape[-1])):
            out[i] = timed_apply(row.guide, mask, out[i])
    return out
