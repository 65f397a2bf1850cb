"""The engine's side of speculative decoding: room, drafts, verification and adaptation.
Greedy output is unchanged; sampled output keeps its distribution, though a seed draws different
tokens than without speculation. Rejected tokens' KV is rolled back by not advancing `num_computed`."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from twinfer.runtime.speculative.accept import verify
from twinfer.runtime.speculative.adaptive import AdaptiveK, CostModel, Ema
from twinfer.runtime.speculative.metrics import SpecStats
from twinfer.runtime.speculative.proposer import Draft, DraftQuery, Proposer

if TYPE_CHECKING:
    from twinfer.runtime.engine.request import Request
    from twinfer.runtime.engine.scheduler import Scheduled
    from twinfer.runtime.kv.block_manager import BlockManager


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding settings of an engine. `max_k` 6: the llama.cpp CPU runner verifies up to 7
    tokens bit-identically while a lone row avoids split-KV attention (docs/architecture.md)."""

    max_k: int = 6
    adaptive: bool = True  # False: always draft max_k tokens
    initial_rate: float = 0.8  # acceptance rate a request starts from
    rate_decay: float = 0.85  # per verified token: the rate follows the last ~7 tokens
    probe_every: int = 16  # decode steps with speculation off before trying again (then 2x, 4x...)
    probe_k: int = 2
    cost_prior: float = 0.15  # price of an unmeasured draft token of a lone request, in plain steps

    def __post_init__(self) -> None:
        if self.max_k < 1 or not 0.0 <= self.initial_rate <= 1.0 or self.probe_every < 0:
            raise ValueError("speculation needs max_k >= 1, initial_rate in [0, 1] and probe_every >= 0")


class Speculator:
    """Owns one proposer, the per-request draft lengths, the cost model and the counters.
    Called by the engine and its scheduler from the engine thread."""

    def __init__(self, proposer: Proposer, config: SpecConfig, max_context: int, blocks: BlockManager):
        self.proposer = proposer
        self.config = config
        self.max_context = max_context
        self.blocks = blocks
        self.cost = CostModel(config.cost_prior)
        self.stats = SpecStats(proposer.name)
        self._states: dict[int, AdaptiveK] = {}

    def draft_k(self, request: Request) -> int:
        """Draft tokens the next decode of `request` may verify (0: decode plainly)."""
        cfg = self.config
        state = self._states.setdefault(request.seq_id, AdaptiveK(Ema(cfg.rate_decay, cfg.initial_rate)))
        if not cfg.adaptive:
            k = cfg.max_k
        elif not self.cost.ready:
            k = 0  # measure what a plain step costs first
        else:
            k = state.next_k(self.cost.relative(cfg.max_k), cfg.probe_every, cfg.probe_k)
        left = min(request.params.max_tokens - len(request.output), self.max_context - request.num_tokens) - 1
        return max(0, min(k, left))

    def propose(self, items: list[Scheduled]) -> dict[int, Draft]:
        """Drafts for the scheduled decodes that have room, by sequence id."""
        queries = [
            DraftQuery(s.request.seq_id, s.request.tokens, s.draft_room, s.request.row,
                       self.blocks.table(s.request.seq_id))
            for s in items if s.draft_room > 0
        ]
        self.stats.decodes += sum(1 for s in items if s.request.num_computed + 1 == s.request.num_tokens)
        if not queries:
            return {}
        started = time.perf_counter()
        try:
            answers = self.proposer.propose(queries)
        except RuntimeError:  # a draft runner out of KV cells or failing: decode plainly this step
            self.stats.errors += 1
            for q in queries:
                self.proposer.release(q.seq_id)
            return {}
        seconds = time.perf_counter() - started
        drafts = {q.seq_id: _cut(d, q.k) for q, d in zip(queries, answers, strict=True) if d and d.tokens}
        self.stats.propose_seconds += seconds
        self.cost.on_propose(seconds, sum(len(d.tokens) for d in drafts.values()))
        return drafts

    def accept(self, request: Request, draft: Draft, logits: np.ndarray) -> list[int]:
        """Verify `draft` against the target's rows for it; the tokens the request emits."""
        tokens = verify(logits, draft, request.row)
        accepted = len(tokens) - 1
        self.stats.record(len(draft.tokens), accepted)
        state = self._states.get(request.seq_id)
        if state is not None:
            state.observe(len(draft.tokens), accepted)
        return tokens

    def on_step(self, seconds: float, items: list[Scheduled], drafts: dict[int, Draft]) -> None:
        """Feed the cost model with a step in which every scheduled request decoded."""
        if all(s.num_tokens == 1 for s in items):
            self.cost.on_step(seconds, len(items), len(items) + sum(len(d.tokens) for d in drafts.values()))

    def release(self, seq_id: int) -> None:
        self._states.pop(seq_id, None)
        self.proposer.release(seq_id)

    def snapshot(self) -> dict[str, Any]:
        return self.stats.snapshot(self.cost.relative(self.config.max_k))


def _cut(draft: Draft, k: int) -> Draft:
    if len(draft.tokens) <= k:
        return draft
    return Draft(draft.tokens[:k], None if draft.dists is None else draft.dists[:k])
