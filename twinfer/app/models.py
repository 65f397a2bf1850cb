"""Open a model's runner: pick the backend, build the runner, load the tokenizer. Every runner is built
by `open_runner` from one `RunnerOptions`; backends are imported lazily."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from twinfer.runtime.errors import BackendUnavailable, OptionError, TwinferError
from twinfer.runtime.loaders import LoadedModel, load_model
from twinfer.runtime.model_path import resolve_path
from twinfer.runtime.runner import Runner
from twinfer.runtime.spec import ModelSpec
from twinfer.runtime.vision.compose import Composition, attach_vision, read_composition

if TYPE_CHECKING:
    from twinfer.backends.llamacpp.options import LlamaCppOptions, RunMode
    from twinfer.planners.placement import Placement

BACKENDS = ("auto", "llamacpp", "torch", "mlx")
KV_LAYOUTS = ("auto", "unified", "streams")  # llama.cpp's KV cache: auto picks one of the other two
STREAMS_MEMORY_SHARE = 1 / 8  # auto takes streams while all of them fit in this share of the machine's memory
_MODULES = {"llamacpp": "llama_cpp", "torch": "torch", "mlx": "mlx"}
__all__ = ["BACKENDS", "KV_LAYOUTS", "OpenedModel", "RunnerOptions", "available", "check_kv_layout",
           "build_in_memory", "choose_backend", "default_context", "open_loaded", "open_model", "open_runner", "resolve_path",
           "resolve_model"]
_EXTRAS = {"llamacpp": "pip install llama-cpp-python", "torch": "pip install 'twinfer[cuda]'",
           "mlx": "pip install 'twinfer[metal]'"}


@dataclass
class OpenedModel:
    runner: Runner
    tokenizer: Any
    loaded: LoadedModel | None
    path: Path

    @property
    def name(self) -> str:
        return self.runner.spec.name or self.path.stem

    @property
    def instruct(self) -> bool:
        """Whether the model was tuned to chat (its name says -it/instruct/chat) and has a template; base
        models get raw text by default, since a chat template makes them worse."""
        meta = self.loaded.metadata if self.loaded else {}
        names = " ".join(str(meta.get(k, "")) for k in ("general.name", "general.finetune", "_name_or_path"))
        names = f"{names} {self.path.name}".lower()
        tuned = any(tag in names for tag in ("-it", " it", "instruct", "chat", "-sft"))
        return tuned and bool(getattr(self.tokenizer, "chat_template", None))


def available(backend: str) -> bool:
    return importlib.util.find_spec(_MODULES[backend]) is not None


def choose_backend(backend: str, path: Path) -> str:
    """`auto` means llama.cpp for GGUF files, torch for Hugging Face folders (MLX where torch is absent)."""
    if backend not in BACKENDS:
        raise BackendUnavailable(f"unknown backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    if backend == "auto":
        is_gguf = path.is_file()
        order = ("llamacpp", "torch", "mlx") if is_gguf else ("torch", "mlx")
        for name in order:
            if available(name):
                return name
        raise BackendUnavailable(f"no backend can run {path}: install one ({'; '.join(_EXTRAS.values())})")
    if not available(backend):
        raise BackendUnavailable(f"backend {backend!r} is not installed: {_EXTRAS[backend]}")
    if backend == "llamacpp" and not path.is_file():
        raise BackendUnavailable(f"the llamacpp backend runs GGUF files; {path} is a folder (use --backend torch)")
    return backend


@dataclass(frozen=True)
class RunnerOptions:
    """How to build a runner, on any backend: what every path that opens one fills in (a session, a memory
    budget's strategy, a draft model, quant's measuring harness). Limits are checked here, once."""

    backend: str = "auto"
    max_seqs: int = 16  # sequences the runner holds KV for at once
    ctx: int | None = None  # KV tokens per sequence; None: `default_context` of the model
    threads: int | None = None
    mode: RunMode = "row-invariant"  # llama.cpp's numerics (backends/llamacpp/options.py)
    kv_layout: str = "unified"  # llama.cpp's KV cache: auto, unified or streams (`streams_fit`)
    kv_type: str | None = None  # llama.cpp's KV element type; None: f16
    dtype: str | None = None  # torch / MLX weights; None: the runner's default
    device: str | None = None
    parallel: tuple[int, int, int] = (1, 1, 1)  # (tp, ep, pp) on the torch backend
    expert_cache_bytes: int | None = None  # torch / MLX: routed experts streamed through a cache this size
    placement: Placement | None = None  # llama.cpp: a plan's GPU layers, host-memory experts and KV type
    compose: Composition | None = None  # a vision encoder from another checkpoint (runtime/vision/compose.py)
    mmproj: str = "auto"  # llama.cpp: the projector file images go through; auto: a sibling mmproj*.gguf; off

    def __post_init__(self) -> None:
        from twinfer.backends.llamacpp.options import RUN_MODES  # no llama_cpp import: a table and a policy

        if self.max_seqs < 1:
            raise OptionError(f"--max-seqs must be at least 1, got {self.max_seqs}", field="max_seqs")
        if self.ctx is not None and self.ctx < 16:
            raise OptionError(f"--ctx must be at least 16 tokens, got {self.ctx}", field="ctx")
        if self.threads is not None and self.threads < 1:
            raise OptionError(f"--threads must be at least 1, got {self.threads}", field="threads")
        if self.mode not in RUN_MODES:
            raise OptionError(f"mode must be one of {', '.join(RUN_MODES)}, got {self.mode!r}", field="mode")
        if self.kv_layout not in KV_LAYOUTS:
            raise OptionError(f"--kv-layout must be one of {', '.join(KV_LAYOUTS)}, got {self.kv_layout!r}",
                              field="kv_layout")
        if min(self.parallel) < 1:
            raise OptionError(f"--tp, --ep and --pp must be at least 1, got {self.parallel}", field="parallel")
        if self.kv_type is not None and self.backend not in ("auto", "llamacpp"):
            raise OptionError(f"a KV type ({self.kv_type}) applies to the llamacpp backend, not {self.backend}",
                              field="kv_type")
        if self.placement is not None and self.backend not in ("auto", "llamacpp"):
            raise OptionError(f"a llama.cpp placement applies to the llamacpp backend, not {self.backend}",
                              field="placement")
        if self.mmproj not in ("auto", "off"):
            if self.backend not in ("auto", "llamacpp"):
                raise OptionError(f"--mmproj is a projector file for a GGUF model on llama.cpp, not {self.backend}: "
                                  "a Hugging Face checkpoint carries its vision tower", field="mmproj")
            if not Path(self.mmproj).expanduser().is_file():
                raise OptionError(f"--mmproj: no file {self.mmproj}", field="mmproj")


def resolve_model(model: str | None) -> tuple[Path, Composition | None]:
    """The model path a user means (None: the default); for a composition file, its language model's
    folder and the composition, whose vision encoder the runner gets."""
    path = resolve_path(model)
    composition = read_composition(path)
    return (composition.language, composition) if composition else (path, None)


def open_model(model: str | None, backend: str = "auto", **options: Any) -> OpenedModel:
    """Load `model` (None: the default; a composition file) on `backend`; `options` are `RunnerOptions` fields."""
    path, composition = resolve_model(model)
    o = RunnerOptions(backend=choose_backend(backend, path), compose=composition, **options)
    if o.kv_layout != "unified":  # the default for callers that never ask; sessions checked theirs already
        check_kv_layout(o.kv_layout, str(path), o.backend)
    return open_loaded(path, load_model(path), o)  # validates the file; weights stay on disk until a runner reads them


def open_loaded(path: Path, loaded: LoadedModel, options: RunnerOptions) -> OpenedModel:
    """The runner `options` ask for over the model at `path` (`loaded` is its spec and weights), and its
    tokenizer. `options.backend` is a chosen one (`choose_backend`)."""
    from twinfer.runtime.tokenizer import load_tokenizer

    return OpenedModel(open_runner(path, loaded, options), load_tokenizer(path), loaded, path)


def open_runner(path: Path, loaded: LoadedModel, options: RunnerOptions) -> Runner:
    """The one place the application builds a runner: each backend's from `options`, with a composition's
    vision encoder attached."""
    runner = _backend_runner(path, loaded, options)
    if options.compose is not None:
        try:
            attach_vision(runner, options.compose)
        except BaseException:
            getattr(runner, "close", lambda: None)()
            raise
    return runner


def _backend_runner(path: Path, loaded: LoadedModel, options: RunnerOptions) -> Runner:
    o = replace(options, ctx=options.ctx or default_context(loaded))
    assert o.ctx is not None
    if o.backend == "llamacpp":
        from twinfer.backends.llamacpp.runner import LlamaCppRunner

        llama = llamacpp_options(loaded, o)
        if o.expert_cache_bytes is not None:  # a budget's paged plan: the file mapped, expert pages under this bound
            llama = replace(llama, paged_experts_bytes=o.expert_cache_bytes, huge_pages=False)
        return LlamaCppRunner(path, llama, spec=loaded.spec)
    if o.parallel != (1, 1, 1):
        if o.backend != "torch":
            raise BackendUnavailable(f"--tp/--ep/--pp run on the torch backend, not {o.backend}: add --backend torch")
        from twinfer.backends.cuda.parallel.runner import open_parallel

        return open_parallel(path, loaded.spec, o.parallel, ctx=o.ctx, threads=o.threads, dtype=o.dtype,
                             device=o.device)
    if o.expert_cache_bytes is not None:
        return _streaming_runner(loaded, o)
    if o.backend == "torch":
        from twinfer.backends.cuda.runner import open_torch_runner

        return open_torch_runner(loaded, kv_tokens=o.ctx, threads=o.threads, dtype=o.dtype, device=o.device)
    from twinfer.backends.metal.runner import load_mlx_runner

    return load_mlx_runner(loaded, kv_tokens=o.ctx, dtype=o.dtype or "float32")


def build_in_memory(backend: str, spec: ModelSpec, weights: Any, *, kv_tokens: int,
                    kv_format: str | None = None) -> Runner:
    """A torch or MLX runner over weights held in memory (quant's measuring harness: a quantized view)."""
    if backend == "torch":
        from twinfer.backends.cuda.runner import build_torch_runner

        return build_torch_runner(spec, weights, kv_tokens=kv_tokens, kv_format=kv_format)
    if backend == "mlx":
        from twinfer.backends.metal.runner import build_mlx_runner

        return build_mlx_runner(spec, weights, kv_tokens=kv_tokens, kv_format=kv_format)
    raise TwinferError(f"runners over in-memory weights run on torch or mlx, not {backend}")


def llamacpp_options(loaded: LoadedModel, o: RunnerOptions) -> LlamaCppOptions:
    """llama.cpp's options for `o`: the KV layout resolved for this machine, the rest by the mode's policy."""
    from twinfer.backends.llamacpp.options import options_for_mode
    from twinfer.backends.llamacpp.runner import KV_TYPE_BYTES

    assert o.ctx is not None
    streams = o.kv_layout == "streams"
    if o.kv_layout == "auto":
        from twinfer.planners.probe import read_host

        kv_bytes = KV_TYPE_BYTES.get(o.kv_type or "f16", 2.0)
        streams = streams_fit(loaded.spec.kv_bytes_per_token(kv_bytes), o.max_seqs, o.ctx, read_host().memory_bytes)
    llama = options_for_mode(o.mode, n_ctx=o.ctx, max_seqs=o.max_seqs, n_threads=o.threads, kv_type=o.kv_type,
                             streams=streams, placement=o.placement)
    return replace(llama, mmproj=o.mmproj)


def _streaming_runner(loaded: LoadedModel, o: RunnerOptions) -> Runner:
    """torch / MLX with routed experts streamed from the file (runtime/experts.py)."""
    assert o.expert_cache_bytes is not None and o.ctx is not None
    if o.backend == "torch":
        from twinfer.backends.cuda.experts import load_streaming_torch_runner

        return load_streaming_torch_runner(loaded, cache_bytes=o.expert_cache_bytes, kv_tokens=o.ctx,
                                           threads=o.threads)
    from twinfer.backends.metal.experts import load_streaming_mlx_runner

    return load_streaming_mlx_runner(loaded, cache_bytes=o.expert_cache_bytes, kv_tokens=o.ctx)


def check_kv_layout(kv_layout: str, model: str | None, backend: str, memory_budget: str | None = None) -> None:
    """Refuse a `--kv-layout` that cannot be had. Streams are a llama.cpp cache layout: on the torch and MLX
    runners, whose paged KV blocks every sequence already owns alone, asking for them is an error rather
    than a flag silently dropped; a memory budget plans one shared cache."""
    if kv_layout != "streams":  # RunnerOptions checked that it is one of KV_LAYOUTS
        return
    if memory_budget is not None:
        raise OptionError("--memory-budget plans one shared KV cache of --ctx tokens: drop --kv-layout streams",
                          field="kv_layout")
    chosen = choose_backend(backend, resolve_model(model)[0])
    if chosen != "llamacpp":
        raise OptionError(f"--kv-layout streams is a llama.cpp cache layout; the {chosen} runner keeps paged "
                          "KV blocks that each sequence owns already: drop --kv-layout streams", field="kv_layout")


def streams_fit(kv_bytes_per_token: float, max_seqs: int, ctx: int, memory_bytes: float) -> bool:
    """Whether `--kv-layout auto` gives llama.cpp a KV stream of `ctx` cells per sequence (llama-server's
    `-np` layout) rather than one shared cache: streams are faster but cost `max_seqs` times the memory,
    so they are taken when all fit in `STREAMS_MEMORY_SHARE` of the machine's memory (docs/architecture.md,
    "The runner contract")."""
    return max_seqs > 1 and max_seqs * ctx * kv_bytes_per_token <= STREAMS_MEMORY_SHARE * memory_bytes


def default_context(loaded: LoadedModel) -> int:
    """KV tokens a runner gets when nobody asked: the planner's default context, within the model's window."""
    from twinfer.planners.search import Request

    return min(Request().context, loaded.spec.max_position)
