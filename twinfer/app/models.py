"""Open a model's runner: pick the backend, build the runner, load the tokenizer.

Every runner the application opens goes through `open_model` (the session, the draft model, quant's
measuring harness through `app.runners`), so the backend choice and its error messages live in one
place. Backends are imported here lazily.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from twinfer.runtime.errors import BackendUnavailable, TwinferError
from twinfer.runtime.loaders import LoadedModel, load_model
from twinfer.runtime.model_path import resolve_path
from twinfer.runtime.runner import Runner

BACKENDS = ("auto", "llamacpp", "torch", "mlx")
KV_LAYOUTS = ("auto", "unified", "streams")  # llama.cpp's KV cache: auto picks one of the other two
STREAMS_MEMORY_SHARE = 1 / 8  # auto takes streams while all of them fit in this share of the machine's memory
_MODULES = {"llamacpp": "llama_cpp", "torch": "torch", "mlx": "mlx"}
__all__ = ["BACKENDS", "KV_LAYOUTS", "OpenedModel", "available", "check_kv_layout", "choose_backend",
           "default_context", "open_model", "ops_runner", "resolve_path"]
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
        """Whether the model was tuned to chat (its name says -it/instruct/chat) and has a template.

        Base models (the embedded Gemma 3 270M is one) continue text; wrapping their prompt in a
        chat template makes them worse, so front ends send them raw text by default.
        """
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


def open_model(model: str | None, backend: str = "auto", *, max_seqs: int = 16, ctx: int | None = None,
               threads: int | None = None, dtype: str | None = None, device: str | None = None,
               runner_options: dict[str, Any] | None = None,
               parallel: tuple[int, int, int] | None = None, kv_layout: str = "unified") -> OpenedModel:
    """Load `model` (None: the default) on `backend` with room for `ctx` KV tokens over `max_seqs` sequences
    (None: `default_context` of the model).

    `runner_options` go to the llama.cpp runner's constructor (e.g. `kv_type`, `unified_kv`).
    `kv_layout` is llama.cpp's cache (`streams_fit` says what "auto" takes); `runner_options["unified_kv"]`
    overrides it. `parallel` = (tp, ep, pp) spreads a torch model over that many processes (backends/cuda/parallel)."""
    from twinfer.runtime.tokenizer import load_tokenizer

    path = resolve_path(model)
    backend = choose_backend(backend, path)
    if kv_layout != "unified":  # the default for callers that never ask; sessions checked theirs already
        check_kv_layout(kv_layout, str(path), backend)
    loaded = load_model(path)  # validates the file and gives the spec; weights stay on disk until a runner reads them
    ctx = ctx or default_context(loaded)
    if backend == "llamacpp":
        from twinfer.backends.llamacpp.runner import KV_TYPE_BYTES, LlamaCppRunner

        options = dict(runner_options or {})
        if kv_layout != "unified" and "unified_kv" not in options:
            from twinfer.planners.probe import read_host

            kv_bytes = KV_TYPE_BYTES.get(options.get("kv_type", "f16"), 2.0)
            streams = kv_layout == "streams" or streams_fit(loaded.spec.kv_bytes_per_token(kv_bytes), max_seqs, ctx,
                                                            read_host().memory_bytes)
            options["unified_kv"] = not streams
        runner: Runner = LlamaCppRunner(path, n_ctx=ctx, max_seqs=max_seqs, n_threads=threads, spec=loaded.spec,
                                        **options)
    elif parallel is not None and parallel != (1, 1, 1):
        if backend != "torch":
            raise BackendUnavailable(f"--tp/--ep/--pp run on the torch backend, not {backend}: add --backend torch")
        from twinfer.backends.cuda.parallel.runner import open_parallel

        runner = open_parallel(path, loaded.spec, parallel, ctx=ctx, threads=threads, dtype=dtype, device=device)
    else:
        runner = ops_runner(backend, loaded, ctx, threads, dtype, device)
    return OpenedModel(runner, load_tokenizer(path), loaded, path)


def check_kv_layout(kv_layout: str, model: str | None, backend: str, memory_budget: str | None = None) -> None:
    """Refuse a `--kv-layout` that cannot be had. Streams are a llama.cpp cache layout: on the torch and MLX
    runners, whose paged KV blocks every sequence already owns alone, asking for them is an error rather
    than a flag silently dropped; a memory budget plans one shared cache."""
    if kv_layout not in KV_LAYOUTS:
        raise TwinferError(f"--kv-layout must be one of {', '.join(KV_LAYOUTS)}, got {kv_layout!r}")
    if kv_layout != "streams":
        return
    if memory_budget is not None:
        raise TwinferError("--memory-budget plans one shared KV cache of --ctx tokens: drop --kv-layout streams")
    chosen = choose_backend(backend, resolve_path(model))
    if chosen != "llamacpp":
        raise TwinferError(f"--kv-layout streams is a llama.cpp cache layout; the {chosen} runner keeps paged "
                           "KV blocks that each sequence owns already: drop --kv-layout streams")


def streams_fit(kv_bytes_per_token: float, max_seqs: int, ctx: int, memory_bytes: float) -> bool:
    """Whether `--kv-layout auto` gives llama.cpp a KV stream of `ctx` cells per sequence (llama-server's
    layout with -np) rather than one cache of `ctx` cells all sequences share.

    Streams cost `max_seqs` times the memory, and they are faster: in a shared cache every row's flash
    attention walks the cells of all sequences, and llama.cpp cuts a step into ubatches without
    regard to them (docs/benchmarks.md: over HTTP, 16 streams served a median 1.07x the tokens a second
    of one shared cache, in six rounds). So streams whenever all of them fit in `STREAMS_MEMORY_SHARE` of the machine's memory:
    Gemma 3 270M at 16 x 4,096 tokens needs 1.2 GB, taken on a 16 GB laptop, not on an 8 GB one.
    """
    return max_seqs > 1 and max_seqs * ctx * kv_bytes_per_token <= STREAMS_MEMORY_SHARE * memory_bytes


def default_context(loaded: LoadedModel) -> int:
    """KV tokens a runner gets when nobody asked: the planner's default context, within the model's window."""
    from twinfer.planners.search import Request

    return min(Request().context, loaded.spec.max_position)


def ops_runner(backend: str, loaded: LoadedModel, ctx: int, threads: int | None,
                dtype: str | None, device: str | None) -> Runner:
    if backend == "torch":
        from twinfer.backends.cuda.runner import open_torch_runner

        return open_torch_runner(loaded, kv_tokens=ctx, threads=threads, dtype=dtype, device=device)
    from twinfer.backends.metal.runner import load_mlx_runner

    return load_mlx_runner(loaded, kv_tokens=ctx, dtype=dtype or "float32")
