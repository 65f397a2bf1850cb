"""Open a model the way the user asked, in one place: what `generate`, `chat`, `serve` and `bench` call.

`open_session` resolves the model, plans it under a memory budget when one is given (requantizing
or pruning it as the plan says), opens the runner, adds the speculative proposer, and returns a
`Session` whose `engine()` builds engines over that runner with the session's context and limits.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from twinfer.app.budget import LocalStrategy, open_with_budget
from twinfer.app.models import OpenedModel, check_kv_layout, default_context, open_model
from twinfer.app.speculate import open_proposer
from twinfer.runtime.engine import Engine, EngineConfig
from twinfer.runtime.errors import TwinferError
from twinfer.runtime.speculative.options import parse_speculate
from twinfer.runtime.speculative.proposer import Proposer

if TYPE_CHECKING:
    from twinfer.planners.hardware import Cluster


@dataclass(frozen=True)
class OpenOptions:
    """How a face asked for a model. Everything `open_session` needs, nothing it has to guess."""

    model: str | None = None  # a GGUF file or Hugging Face folder; None: the embedded default
    backend: str = "auto"
    max_seqs: int = 1  # sequences the runner holds KV for at once
    ctx: int | None = None  # KV tokens per sequence; None: the planner's default context, within the window
    threads: int | None = None
    speculate: str = "off"  # --speculate: off, ngram, draft:PATH or self:N
    parallel: tuple[int, int, int] = (1, 1, 1)  # (tp, ep, pp) on the torch backend
    memory_budget: str | None = None  # --memory-budget: plan, transform and open within it
    allow_pruning: bool = False
    batch_invariant: bool = False  # exact batching: a batched request's text equals it run alone
    hardware: Cluster | None = None  # what a budget is planned on; None: the probed host
    runner_options: dict[str, Any] = field(default_factory=dict)  # extra llama.cpp runner options
    kv_layout: str = "auto"  # llama.cpp's KV cache: auto, unified or streams (app.models.streams_fit)

    def __post_init__(self) -> None:
        if self.max_seqs < 1 or (self.ctx is not None and self.ctx < 16):
            raise TwinferError(f"need at least one sequence and 16 tokens of context (got max_seqs={self.max_seqs}, "
                               f"ctx={self.ctx})")
        if self.threads is not None and self.threads < 1:
            raise TwinferError(f"--threads must be at least 1, got {self.threads}")
        parse_speculate(self.speculate)  # a typo fails before anything loads
        check_kv_layout(self.kv_layout, self.model, self.backend, self.memory_budget)


@dataclass
class Session:
    """An opened model, its proposer, and what the budget chose; builds engines over them."""

    opened: OpenedModel
    proposer: Proposer | None
    strategy: LocalStrategy | None
    options: OpenOptions
    ctx: int  # the context the runner was opened (and a budget planned) for: each engine's max_context

    def engine(self, **config: Any) -> Engine:
        """An engine over the session's runner and proposer; `config` overrides EngineConfig fields."""
        o = self.options
        base = EngineConfig(max_seqs=o.max_seqs, max_context=self.ctx, batch_invariant=o.batch_invariant)
        return Engine(self.opened.runner, self.opened.tokenizer, replace(base, **config), self.proposer)

    def close(self) -> None:
        """Free the runner (and a draft model's): the session is unusable afterwards."""
        for obj in (self.proposer, self.opened.runner):
            close = getattr(obj, "close", None)
            if close is not None:
                close()


def open_session(options: OpenOptions) -> Session:
    """Resolve, plan under the budget, transform, open the runner and add the proposer."""
    o = options
    strategy = None
    if o.memory_budget is not None:
        opened, strategy = open_with_budget(o.model, o.backend, o.memory_budget, allow_pruning=o.allow_pruning,
                                            max_seqs=o.max_seqs, ctx=o.ctx, threads=o.threads, hardware=o.hardware)
    else:
        runner_options = dict(o.runner_options)
        if o.batch_invariant:  # llama.cpp: each sequence in its own KV stream, its cells where they lie alone
            runner_options.setdefault("unified_kv", False)
        elif parse_speculate(o.speculate)[0] == "off":
            # llama.cpp's own default, weights repacked into its interleaved GEMM tiles: faster batched
            # steps, but a row's logits then depend on its place in the batch, which only the exact
            # modes (batch-invariant, speculative verification) must rule out
            runner_options.setdefault("repack", True)
        opened = open_model(o.model, o.backend, max_seqs=o.max_seqs, ctx=o.ctx, threads=o.threads,
                            parallel=o.parallel, runner_options=runner_options or None, kv_layout=o.kv_layout)
    assert opened.loaded is not None
    session = Session(opened, None, strategy, o, o.ctx or default_context(opened.loaded))
    try:
        session.proposer = open_proposer(o.speculate, opened, max_seqs=o.max_seqs, ctx=session.ctx,
                                         threads=o.threads)
    except BaseException:
        session.close()
        raise
    return session
