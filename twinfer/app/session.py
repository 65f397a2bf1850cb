"""Open a model the way the user asked, in one place: what `generate`, `chat`, `serve` and `bench` call.
`open_session` returns a `Session` whose `engine()` builds engines over its runner."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from twinfer.app.budget import BudgetRequest, LocalStrategy, fit_budget, parse_budget
from twinfer.app.models import (
    OpenedModel,
    RunnerOptions,
    check_kv_layout,
    choose_backend,
    default_context,
    open_loaded,
    open_runner,
    resolve_model,
)
from twinfer.app.speculate import open_proposer
from twinfer.runtime.engine import Engine, EngineConfig
from twinfer.runtime.errors import OptionError
from twinfer.runtime.loaders import load_model
from twinfer.runtime.speculative.options import parse_speculate
from twinfer.runtime.speculative.proposer import Proposer
from twinfer.runtime.vision.compose import check_width

if TYPE_CHECKING:
    from twinfer.backends.llamacpp.options import RunMode
    from twinfer.planners.hardware import Cluster


@dataclass(frozen=True)
class OpenOptions:
    """How a face asked for a model. Everything `open_session` needs, nothing it has to guess; the limits
    are the runner's (`RunnerOptions`), checked when this is built."""

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
    kv_layout: str = "auto"  # llama.cpp's KV cache: auto, unified or streams (app.models.streams_fit)
    mode: RunMode | None = None  # the runner's numerics; None: from batch_invariant and speculate (`run_mode`)
    mmproj: str = "auto"  # llama.cpp: the projector file images go through (auto: a sibling mmproj*.gguf; off)

    def __post_init__(self) -> None:
        self.runner_options()  # the runner's limits, and a typo in --speculate, fail before anything loads
        if self.memory_budget is not None:
            parse_budget(self.memory_budget)
        if self.batch_invariant and self.mode not in (None, "batch-invariant"):
            raise OptionError(f"--batch-invariant runs in batch-invariant mode, not {self.mode!r}", field="mode")
        check_kv_layout(self.kv_layout, self.model, self.backend, self.memory_budget)

    @property
    def run_mode(self) -> RunMode:
        """Batch-invariant when asked; row-invariant under speculation, whose verification compares a
        drafted row's logits with what the row would get alone; fast otherwise."""
        if self.mode is not None:
            return self.mode
        if self.batch_invariant:
            return "batch-invariant"
        return "fast" if parse_speculate(self.speculate)[0] == "off" else "row-invariant"

    def runner_options(self, backend: str = "auto", ctx: int | None = None) -> RunnerOptions:
        """The runner these options ask for (on `backend`, for `ctx` tokens once those are resolved)."""
        return RunnerOptions(backend=backend, max_seqs=self.max_seqs, ctx=ctx or self.ctx, threads=self.threads,
                             mode=self.run_mode, kv_layout=self.kv_layout, parallel=self.parallel, mmproj=self.mmproj)


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
    """Resolve, plan under the budget, transform, open the runner and add the proposer: every face (and
    every torchrun worker) reaches a runner through here."""
    o = options
    path, composition = resolve_model(o.model)  # a composition file: its language model, and the encoder to attach
    backend = choose_backend(o.backend, path)
    loaded = load_model(path)  # validates the file and gives the spec; weights stay on disk until a runner reads them
    if composition is not None:
        check_width(composition, loaded.spec)  # before any weight is read
    ctx = o.ctx or default_context(loaded)
    runner_options, strategy = replace(o.runner_options(backend, ctx), compose=composition), None
    if backend == "llamacpp" and o.mmproj == "auto":  # beside the user's file: a budget may run a copy elsewhere
        from twinfer.backends.llamacpp.vision import projector_path

        found = projector_path(path, "auto", loaded.spec.hidden_size)
        runner_options = replace(runner_options, mmproj=str(found) if found else "off")
    if o.memory_budget is not None:
        request = BudgetRequest(parse_budget(o.memory_budget), ctx, o.max_seqs, o.allow_pruning, o.threads, o.hardware,
                                ctx_given=o.ctx is not None)
        from twinfer.runtime.tokenizer import load_tokenizer

        strategy, run_path, run_loaded = fit_budget(path, loaded, backend, request)
        ctx = strategy.ctx or ctx  # a default context the budget shrank to fit
        runner_options = replace(runner_options, ctx=ctx)
        runner = open_runner(run_path, run_loaded, strategy.runner_options(runner_options))
        opened = OpenedModel(runner, load_tokenizer(path), run_loaded, path)
    else:
        opened = open_loaded(path, loaded, runner_options)
    session = Session(opened, None, strategy, o, ctx)
    try:
        session.proposer = open_proposer(o.speculate, opened, max_seqs=o.max_seqs, ctx=ctx, threads=o.threads)
    except BaseException:
        session.close()
        raise
    return session
