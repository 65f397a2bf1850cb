"""Choose a weight format per tensor that minimizes measured KL at a bits-per-weight budget.
Measure each group's KL alone, solve the multiple-choice knapsack on the sum, then keep only the moves
that lower the *measured* KL of the whole assignment (docs/quantization.md). `KLProbe` measures on the
torch backend in float32 by swapping dequantized weights into one runner."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from twinfer.quant.kl import KLAccumulator
from twinfer.quant.linear import QuantizedWeight, supports
from twinfer.quant.model_io import kind_of, layer_of, quantizable
from twinfer.quant.registry import FORMATS

if TYPE_CHECKING:
    from twinfer.quant.fidelity import RunnerFactory

Assignment = dict[str, str]


@dataclass(frozen=True)
class KLStats:
    mean: float
    p99: float
    same_top_p: float


class KLProbe:
    """Measures KL(unquantized || assignment) on fixed token windows with one torch runner."""

    def __init__(self, spec: Any, weights: Any, windows: Sequence[list[int]], seed: int = 0,
                 share: KLProbe | None = None, *, runners: RunnerFactory | None = None) -> None:
        """`runners` builds the torch runner; `share`: another probe of the same model whose runner and
        weight cache this one reuses instead (its KV cache must hold the longest window)."""
        import torch

        from twinfer.quant.fidelity import RunnerSource

        self._torch = torch
        self.weights = weights
        self.seed = seed
        self.windows = [w for w in windows if len(w) > 1]
        if share is None:
            if runners is None:
                raise ValueError("KLProbe needs `runners` (a RunnerFactory) or a probe to `share`")
            longest = max(len(w) for w in self.windows)
            runner: Any = runners.build("torch", spec, weights, kv_tokens=max(64, -(-longest // 16) * 16))
            self.runner = runner  # a torch OpsRunner: its `weights` dict is what `measure` swaps
            self.original = {n: runner.weights[n] for n in quantizable(weights)}
            self._dense: dict[tuple[str, str], Any] = {}
        else:
            self.runner, self.original, self._dense = share.runner, share.original, share._dense
        self.source = RunnerSource(self.runner)
        self.reference = [self.source.logits(w)[:-1] for w in self.windows]
        self.evaluations = 0

    def forget(self, fmt: str | None = None) -> None:
        """Drop cached dequantized weights (of one format, or all) to bound memory."""
        for key in [k for k in self._dense if fmt is None or k[1] == fmt]:
            del self._dense[key]

    def dense(self, name: str, fmt: str) -> Any:
        """The dequantized weight of `name` in `fmt` as a torch tensor (cached)."""
        key = (name, fmt)
        if key not in self._dense:
            qw = QuantizedWeight.quantize(fmt, self.weights.load(name), seed=self.seed)
            self._dense[key] = self._torch.from_numpy(qw.dequantize())
        return self._dense[key]

    def measure(self, assignment: Mapping[str, str]) -> KLStats:
        for name, fmt in assignment.items():
            self.runner.weights[name] = self.dense(name, fmt)
        try:
            acc = KLAccumulator()
            for ref, w in zip(self.reference, self.windows, strict=True):
                acc.add(ref, self.source.logits(w)[:-1])
        finally:
            self.runner.weights.update(self.original)
        self.evaluations += 1
        r = acc.report("reference", "candidate", "probe")
        return KLStats(r.mean_kl, r.p99_kl, r.top1_agreement)


def groups_of(names: Sequence[str], granularity: str) -> dict[str, list[str]]:
    """Tensor groups: "block" (each layer's attn and mlp), "layer", or "tensor" (one each)."""
    out: dict[str, list[str]] = {}
    for n in names:
        if granularity == "tensor":
            key = n
        elif granularity == "layer":
            key = f"layers.{layer_of(n)}"
        elif granularity == "block":
            key = f"layers.{layer_of(n)}.{kind_of(n)}"
        else:
            raise ValueError(f"granularity must be tensor, block or layer, got {granularity!r}")
        out.setdefault(key, []).append(n)
    return out


@dataclass
class SearchResult:
    assignment: Assignment
    bits: float
    kl: KLStats
    predicted_kl: float  # the additive model's sum for the final assignment
    sensitivities: dict[str, dict[str, float]] = field(default_factory=dict)
    history: list[tuple[str, float, float]] = field(default_factory=list)  # (step, bits, measured KL)
    evaluations: int = 0


class FormatSearch:
    """Sensitivity measurement, knapsack allocation and measured interaction search (module docstring)."""

    def __init__(self, probe: KLProbe, formats: Sequence[str], granularity: str = "block",
                 log: Callable[[str], None] | None = None) -> None:
        self.probe = probe
        names = quantizable(probe.weights)
        self.groups = groups_of(names, granularity)
        self.params = {g: sum(float(np.prod(probe.weights.shape(n))) for n in ns) for g, ns in self.groups.items()}
        self.total = sum(self.params.values())
        self.formats = sorted(
            (f for f in formats if all(supports(f, tuple(probe.weights.shape(n))) for n in names)),
            key=lambda f: FORMATS[f],
        )
        if not self.formats:
            raise ValueError(f"none of the formats {list(formats)} can store every layer projection")
        self.sens: dict[str, dict[str, float]] = {}
        self.log = log or (lambda _msg: None)

    def assignment(self, choice: Mapping[str, str]) -> Assignment:
        return {n: choice[g] for g, ns in self.groups.items() for n in ns}

    def bits(self, choice: Mapping[str, str]) -> float:
        return sum(self.params[g] * FORMATS[f] for g, f in choice.items()) / self.total

    def measure_sensitivities(self) -> dict[str, dict[str, float]]:
        for i, (g, ns) in enumerate(self.groups.items()):
            self.sens[g] = {f: self.probe.measure(dict.fromkeys(ns, f)).mean for f in self.formats}
            self.log(f"sensitivity {i + 1}/{len(self.groups)} {g}: "
                     + " ".join(f"{f}={v:.5f}" for f, v in self.sens[g].items()))
        return self.sens

    def allocate(self, budget: float) -> dict[str, str]:
        """Additive-model optimum at `budget` bits per weight (Lagrangian sweep + greedy fill)."""
        if budget < FORMATS[self.formats[0]] - 1e-9:
            raise ValueError(f"budget {budget} is below the cheapest format {self.formats[0]} "
                             f"({FORMATS[self.formats[0]]:.3f} bits per weight)")

        def pick(lam: float) -> dict[str, str]:
            return {g: min(self.formats, key=lambda f: self.sens[g][f] + lam * self.params[g] * FORMATS[f])
                    for g in self.groups}

        lo, hi = 0.0, 1.0
        while self.bits(pick(hi)) > budget and hi < 1e12:
            hi *= 4
        for _ in range(60):
            mid = math.sqrt(lo * hi) if lo > 0 else hi / 1e6
            if self.bits(pick(mid)) > budget:
                lo = mid
            else:
                hi = mid
        return self._fill(pick(hi), budget)

    def _fill(self, choice: dict[str, str], budget: float) -> dict[str, str]:
        """Spend leftover bits on the upgrades with the best predicted KL drop per bit."""
        while True:
            best, best_gain = None, 0.0
            for g, f in choice.items():
                for up in self.formats:
                    extra = self.params[g] * (FORMATS[up] - FORMATS[f])
                    if extra <= 0 or self.bits({**choice, g: up}) > budget + 1e-9:
                        continue
                    gain = (self.sens[g][f] - self.sens[g][up]) / extra
                    if gain > best_gain:
                        best, best_gain = (g, up), gain
            if best is None:
                return choice
            choice = {**choice, best[0]: best[1]}

    def predicted(self, choice: Mapping[str, str]) -> float:
        return sum(self.sens[g][f] for g, f in choice.items())

    def search(self, budget: float, rounds: int = 3, tries: int = 4) -> SearchResult:
        """Allocate, then improve by measured moves; each round measures up to `tries` candidates."""
        if not self.sens:
            self.measure_sensitivities()
        choice = self.allocate(budget)
        kl = self.probe.measure(self.assignment(choice))
        history = [("allocation", self.bits(choice), kl.mean)]
        self.log(f"allocation: {self.bits(choice):.3f} bpw, predicted {self.predicted(choice):.5f}, "
                 f"measured {kl.mean:.5f}")
        for r in range(rounds):
            improved = False
            for cand in self._moves(choice, budget)[:tries]:
                ckl = self.probe.measure(self.assignment(cand))
                if ckl.mean < kl.mean:
                    choice, kl, improved = cand, ckl, True
            history.append((f"round {r + 1}", self.bits(choice), kl.mean))
            self.log(f"round {r + 1}: {self.bits(choice):.3f} bpw, measured {kl.mean:.5f}")
            if not improved:
                break
        return SearchResult(self.assignment(choice), self.bits(choice), kl, self.predicted(choice),
                            self.sens, history, self.probe.evaluations)

    def _moves(self, choice: dict[str, str], budget: float) -> list[dict[str, str]]:
        """In-budget neighbours (one group up a format, optionally another down), best predicted first."""
        order = self.formats
        cands: list[tuple[float, dict[str, str]]] = []
        for a, fa in choice.items():
            ia = order.index(fa)
            if ia + 1 >= len(order):
                continue
            up = {**choice, a: order[ia + 1]}
            for b, fb in [(None, None), *choice.items()]:
                cand = up
                if b is not None and fb is not None:
                    ib = order.index(fb)
                    if b == a or ib == 0:
                        continue
                    cand = {**up, b: order[ib - 1]}
                if self.bits(cand) <= budget + 1e-9:
                    cands.append((self.predicted(cand), cand))
        cands.sort(key=lambda c: c[0])
        return [c for _, c in cands]


def uniform(names: Sequence[str], fmt: str) -> Assignment:
    return dict.fromkeys(names, fmt)
