"""How many tokens to draft: per request, the k in [0, max_k] that maximizes E(k) / C(k), the expected
tokens over the measured step cost; k = 0 turns speculation off until a later probe
(docs/internals.md, "Speculative decoding")."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class Ema:
    """An exponential moving average; it starts at `value` (a prior) or at its first sample."""

    decay: float
    value: float | None = None

    def add(self, x: float, weight: float = 1.0) -> None:
        keep = self.decay**weight if self.value is not None else 0.0
        self.value = keep * (self.value or 0.0) + (1.0 - keep) * x

    def get(self, default: float) -> float:
        return default if self.value is None else self.value


class Window:
    """The fastest of the last `size` samples. Interference only adds time (another process takes
    the cores, sometimes for seconds), so the minimum is the step's own cost, as in `timeit`."""

    def __init__(self, size: int = 16):
        self.samples: deque[float] = deque(maxlen=size)

    def add(self, x: float) -> None:
        self.samples.append(x)

    def __len__(self) -> int:
        return len(self.samples)

    def low(self, default: float = 0.0) -> float:
        return min(self.samples) if self.samples else default


@dataclass
class CostModel:
    """Seconds of decode-only steps by tokens computed, and the proposer's seconds per drafted token, fed
    after every all-decode step; a request's k drafts cost T(n + k) - T(n) against T(R) / R."""

    prior: float = 0.15  # extra cost of an unmeasured drafted token, in plain rows, for one request
    wide_prior: float = 1.0  # ... when several decode: a batched row is cheap, a token about as dear
    min_samples: int = 3  # a step size is priced from measurements once it has this many
    seconds: dict[int, Window] = field(default_factory=dict)  # tokens in the step -> seconds
    propose: Window = field(default_factory=Window)  # proposer seconds per drafted token
    rows: int = 1  # decode rows of the latest step
    tokens: int = 1  # tokens of the latest step (rows + drafts)

    def on_step(self, seconds: float, rows: int, tokens: int) -> None:
        if rows > 0:
            self.seconds.setdefault(tokens, Window()).add(seconds)
            self.rows, self.tokens = rows, tokens

    def on_propose(self, seconds: float, tokens: int) -> None:
        if tokens > 0:
            self.propose.add(seconds / tokens)

    @property
    def ready(self) -> bool:
        """Whether plain steps of the current width were measured: until then, decode plainly."""
        return self._measured(self.rows) is not None

    def relative(self, max_k: int) -> list[float]:
        """C(k) for k = 0..max_k: a request's cost with k drafted tokens over its plain share."""
        plain = self._measured(self.rows)
        if plain is None:
            return [1.0 + self.prior * k for k in range(max_k + 1)]
        row = plain / self.rows
        prior = (self.prior if self.rows == 1 else self.wide_prior) * row
        n = self.rows + (self.tokens - self.rows) * (self.rows - 1) // self.rows  # others' drafts
        times = [self._time(n, prior)]
        for k in range(1, max_k + 1):
            measured = self._measured(n + k)
            times.append(measured if measured is not None else times[-1] + prior)
        propose = self.propose.low() / row
        return [1.0 + (t - times[0]) / row + k * propose for k, t in enumerate(times)]

    def _measured(self, tokens: int) -> float | None:
        window = self.seconds.get(tokens)
        if window is None or len(window) < self.min_samples or window.low() <= 0.0:
            return None
        return window.low()

    def _time(self, tokens: int, per_token: float) -> float:
        """Measured seconds of a step of `tokens`, else extrapolated from a measured smaller one."""
        for n in range(tokens, self.rows - 1, -1):
            measured = self._measured(n)
            if measured is not None:
                return measured + (tokens - n) * per_token
        return tokens * per_token


def expected_tokens(rate: float, k: int) -> float:
    """Mean tokens one verification emits when each draft token is accepted with probability `rate`."""
    return float(sum(rate**i for i in range(k + 1)))


def best_k(rate: float, costs: list[float], margin: float = 0.02) -> int:
    """The draft length that maximizes tokens per unit of time; 0 unless it beats plain decoding."""
    gains = [expected_tokens(rate, k) / cost for k, cost in enumerate(costs)]
    k = max(range(len(gains)), key=gains.__getitem__)
    return k if gains[k] > 1.0 + margin else 0


@dataclass
class AdaptiveK:
    """One request's running acceptance rate and current draft length."""

    rate: Ema
    k: int = 0
    idle: int = 0  # decode steps since speculation was turned off, or since the last probe
    interval: int = 0  # steps between probes: doubles after each probe that finds nothing

    def observe(self, proposed: int, accepted: int) -> None:
        """A verification kept `accepted` of `proposed` tokens: accepted successes, then one miss."""
        trials = accepted + (1 if accepted < proposed else 0)
        if trials:
            self.rate.add(accepted / trials, trials)

    def next_k(self, costs: list[float], probe_every: int, probe_k: int) -> int:
        """Draft length for the next decode step (a probe when speculation has been off a while;
        probes back off to every 16 * probe_every steps, a draft model's catch-up is not free)."""
        self.k = best_k(self.rate.get(0.0), costs)
        if self.k:
            self.idle, self.interval = 0, probe_every
            return self.k
        self.idle += 1
        self.interval = self.interval or probe_every
        if probe_every and self.idle >= self.interval:
            self.idle, self.interval = 0, min(2 * self.interval, 16 * probe_every)
            return min(probe_k, len(costs) - 1)
        return 0
