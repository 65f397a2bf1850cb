"""KL divergence of next-token distributions: how faithfully a candidate serves a reference.
Both sides score the same token stream, teacher-forced; the statistics follow llama.cpp's
`llama-perplexity --kl-divergence` (mean, median, p99, max, same top token, RMS delta p)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def kl_rows(ref_logits: np.ndarray, cand_logits: np.ndarray) -> np.ndarray:
    """KL(ref || cand) per row of two [rows, vocab] logit arrays, in nats (float64)."""
    if ref_logits.shape != cand_logits.shape:
        raise ValueError(f"logit shapes differ: {ref_logits.shape} vs {cand_logits.shape}")
    return _kl_logprobs(log_softmax(ref_logits), log_softmax(cand_logits))


def _kl_logprobs(lp: np.ndarray, lq: np.ndarray) -> np.ndarray:
    kl = (np.exp(lp) * (lp - lq)).sum(axis=-1)
    return np.maximum(kl, 0.0)  # rounding can make an exact match slightly negative


@dataclass
class KLAccumulator:
    """Collects per-row KL and top-1 agreement over many windows."""

    kl: list[np.ndarray] = field(default_factory=list)
    agree: list[np.ndarray] = field(default_factory=list)
    delta_p: list[np.ndarray] = field(default_factory=list)

    def add(self, ref_logits: np.ndarray, cand_logits: np.ndarray, targets: np.ndarray | None = None) -> None:
        """Score rows; `targets` [rows] are the actual next tokens (for RMS delta p)."""
        if ref_logits.shape != cand_logits.shape:
            raise ValueError(f"logit shapes differ: {ref_logits.shape} vs {cand_logits.shape}")
        lp, lq = log_softmax(ref_logits), log_softmax(cand_logits)  # once: the 262k-wide passes dominate
        self.kl.append(_kl_logprobs(lp, lq))
        self.agree.append(np.argmax(ref_logits, axis=-1) == np.argmax(cand_logits, axis=-1))
        if targets is not None:
            t = np.asarray(targets, dtype=np.int64)[:, None]
            p_ref = np.exp(np.take_along_axis(lp, t, axis=-1))[:, 0]
            p_cand = np.exp(np.take_along_axis(lq, t, axis=-1))[:, 0]
            self.delta_p.append(p_cand - p_ref)

    def report(self, reference: str, candidate: str, corpus: str) -> KLReport:
        kl = np.concatenate(self.kl) if self.kl else np.zeros(0)
        agree = np.concatenate(self.agree) if self.agree else np.zeros(0, dtype=bool)
        if kl.size == 0:
            raise ValueError("no tokens were scored")
        return KLReport(
            reference=reference, candidate=candidate, corpus=corpus,
            mean_kl=float(kl.mean()), median_kl=float(np.median(kl)),
            p99_kl=float(np.percentile(kl, 99)), max_kl=float(kl.max()),
            top1_agreement=float(agree.mean()), tokens=int(kl.size),
            rms_delta_p=float(np.sqrt(np.mean(np.concatenate(self.delta_p) ** 2))) if self.delta_p else None,
        )


@dataclass(frozen=True)
class KLReport:
    reference: str
    candidate: str
    corpus: str
    mean_kl: float
    median_kl: float
    p99_kl: float
    max_kl: float
    top1_agreement: float  # llama.cpp's "same top p": both sides rank the same token first
    tokens: int
    rms_delta_p: float | None = None  # RMS of p_cand(next) - p_ref(next), when tokens were given

    @property
    def same_top_p(self) -> float:
        return self.top1_agreement

    def as_dict(self) -> dict[str, float | int | str | None]:
        return {**asdict(self), "same_top_p": self.same_top_p}

    def lines(self) -> list[str]:
        return [
            f"KL({self.reference} || {self.candidate}) on {self.tokens} tokens of {self.corpus}",
            f"  mean   {self.mean_kl:.6f}",
            f"  median {self.median_kl:.6f}",
            f"  p99    {self.p99_kl:.6f}",
            f"  max    {self.max_kl:.6f}",
            f"  same top p {100 * self.top1_agreement:.3f} % (top-1 agreement)",
            *([f"  RMS delta p {100 * self.rms_delta_p:.3f} %"] if self.rms_delta_p is not None else []),
        ]
