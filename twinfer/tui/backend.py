"""What the chat app needs from a model (`ChatBackend`, the app's only view of the engine) and
`EngineBackend` over an `AsyncEngine`; `load_backend` blocks on a worker thread and raises `TwinferError`
with what to do."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from twinfer.runtime.engine import RequestOutput, SamplingParams
from twinfer.runtime.errors import PlanError, TwinferError

if TYPE_CHECKING:
    from twinfer.app import OpenOptions, Session

Progress = Callable[[int, int, str], None]  # (step, total steps, what is happening)


@dataclass(frozen=True)
class PlanSummary:
    """The planner's choice for this model on this machine, in a few words."""

    weights: str  # e.g. "Q4_K_M (as stored)"
    kv: str  # e.g. "Q8_0 (8.5 bits)"
    memory: str  # e.g. "406 MB of 21.5 GB"
    experts: str  # "dense", "all resident" or "stream 40%"
    hardware: str
    fits: bool = True
    suggestion: str = ""


@dataclass(frozen=True)
class ModelInfo:
    name: str
    path: str
    backend: str  # "llamacpp", "torch", "mlx" (plus device and threads where known)
    window: int  # tokens of context (prompt + reply)
    prompt_format: str  # "template" or "transcript"
    plan: PlanSummary | None = None
    plan_error: str = ""


class ChatBackend(Protocol):
    """A loaded model the app can chat with, called from its event loop only: `start` returns a request's
    stream, `abort` ends it early (finish_reason "abort", KV freed)."""

    info: ModelInfo
    tokenizer: Any

    async def start(self, tokens: list[int], params: SamplingParams) -> tuple[str, AsyncIterator[RequestOutput]]: ...

    def abort(self, request_id: str) -> None: ...

    @property
    def running(self) -> int: ...

    async def close(self) -> None: ...


class EngineBackend:
    """A model opened by the app layer (`app.open_session`), served by an `AsyncEngine`."""

    def __init__(self, session: Session, info: ModelInfo):
        from twinfer.runtime.engine.async_engine import AsyncEngine

        self.session = session
        self.opened = session.opened
        self.tokenizer = self.opened.tokenizer
        engine = session.engine(max_context=info.window)
        self.engine = AsyncEngine(engine, max_queue=4, name="twinfer-chat-engine")
        self.info = ModelInfo(info.name, info.path, info.backend, engine.max_context, info.prompt_format,
                              info.plan, info.plan_error)
        self.engine.start()

    async def start(self, tokens: list[int], params: SamplingParams) -> tuple[str, AsyncIterator[RequestOutput]]:
        stream = await self.engine.generate(tokens, params)
        return stream.request_id, stream

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    @property
    def running(self) -> int:
        """Requests the engine is computing or holding (0 once an aborted request is gone)."""
        stats = self.engine.stats
        return stats.running + stats.waiting + self.engine.active

    async def close(self) -> None:
        await self.engine.shutdown(drain=False)
        self.session.close()


@dataclass(frozen=True)
class LoadOptions:
    """The model `twinfer chat` opens; checked when built, so a bad flag fails before the screen opens."""

    model: str | None = None
    backend: str = "auto"
    ctx: int = 4096
    threads: int | None = None
    template: bool | None = None  # None: the template for chat-tuned models, a transcript for base models
    memory_budget: str | None = None  # --memory-budget: open through the app layer's local strategy
    allow_pruning: bool = False
    speculate: str = "off"  # --speculate: off, ngram, draft:PATH or self:N
    mmproj: str = "auto"  # --mmproj: a GGUF model's projector file, auto (a sibling mmproj*.gguf) or off

    def __post_init__(self) -> None:
        if self.ctx < 64:  # a chat turn's history and reply need room; the runner's own limit is lower
            raise TwinferError(f"--ctx must be at least 64 tokens, got {self.ctx}", field="ctx")
        self.open_options()  # the runner's limits, --speculate and --memory-budget

    def open_options(self, model: str | None = None, backend: str | None = None) -> OpenOptions:
        """The session these options open (`model` and `backend` once resolved)."""
        from twinfer.app import OpenOptions

        return OpenOptions(model or self.model, backend or self.backend, max_seqs=2, ctx=self.ctx,
                           threads=self.threads, speculate=self.speculate, memory_budget=self.memory_budget,
                           allow_pruning=self.allow_pruning, mmproj=self.mmproj)


def load_backend(options: LoadOptions, progress: Progress) -> EngineBackend:
    """Resolve, plan, load and start the model (blocking; run it on a worker thread)."""
    from twinfer.app import open_session
    from twinfer.app.models import choose_backend, resolve_path

    total = 4
    progress(0, total, "finding the model")
    path = resolve_path(options.model)
    backend = choose_backend(options.backend, path)
    progress(1, total, f"planning {path.name} for this machine")
    plan, plan_error = None, ""
    try:
        plan = plan_summary(path, options.ctx)
    except PlanError:
        raise
    except Exception as exc:  # noqa: BLE001 - the plan is informative; chatting works without it
        plan_error = f"{type(exc).__name__}: {exc}"
    if plan is not None and not plan.fits:
        raise PlanError(f"{path.name} does not fit in this machine's memory at {options.ctx} tokens of context: "
                        f"{plan.suggestion or 'try a smaller quantization or a lower --ctx'} "
                        f"(`twinfer plan {path}` explains)")
    progress(2, total, f"loading {path.name} on {backend} (the first run also converts the tokenizer)")
    session = open_session(options.open_options(str(path), backend))
    opened = session.opened
    progress(3, total, "starting the engine")
    instruct = bool(getattr(opened, "instruct", False))
    use_template = instruct if options.template is None else options.template
    if use_template and not getattr(opened.tokenizer, "chat_template", None):
        use_template = False
    info = ModelInfo(opened.name, str(path), _describe(opened.runner), options.ctx,
                     "template" if use_template else "transcript", plan, plan_error)
    backend_obj = EngineBackend(session, info)
    progress(4, total, "ready")
    return backend_obj


def _describe(runner: Any) -> str:
    try:
        d = runner.describe()
    except Exception:  # noqa: BLE001 - descriptive only
        return str(getattr(runner, "backend", "unknown"))
    parts = [str(d.get("backend", getattr(runner, "backend", "?"))), str(d.get("device", ""))]
    threads = d.get("n_threads")
    if threads:
        parts.append(f"{threads} thread{'s' if threads != 1 else ''}")
    return ", ".join(p for p in parts if p)


def plan_summary(path: Path, ctx: int) -> PlanSummary:
    """What `twinfer plan PATH --context CTX` chooses on the detected hardware, summarized."""
    from twinfer.planners import probe
    from twinfer.planners.plan import make_plan
    from twinfer.planners.search import Request
    from twinfer.planners.source import resolve
    from twinfer.planners.units import fmt_bytes

    profile = resolve(str(path))
    cluster = probe.detect()
    plan = make_plan(profile, cluster, Request(min(ctx, profile.spec.max_position), 1, "auto", "auto"))
    hardware = cluster.device.label
    if plan.chosen is None or plan.strategy is None:
        return PlanSummary("-", "-", "-", "-", hardware, fits=False, suggestion=plan.suggestion)
    s, mem = plan.strategy, plan.chosen.memory
    if profile.moe is None:
        experts = "dense"
    else:
        experts = f"stream {s.stream_fraction:.0%}" if s.stream_fraction else "all resident"
    return PlanSummary(
        weights=s.mix.label or s.mix.name,
        kv=f"{s.kv.label} ({s.kv.bits:g} bits)",
        memory=f"{fmt_bytes(mem.used)} of {fmt_bytes(mem.capacity)}",
        experts=experts,
        hardware=hardware,
    )


def describe_error(exc: BaseException) -> str:
    """One message for a load failure, with what to do."""
    if isinstance(exc, TwinferError):
        return str(exc)
    return f"{type(exc).__name__}: {exc} (this looks like a twinfer bug; please report it)"
