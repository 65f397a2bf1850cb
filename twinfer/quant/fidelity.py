"""`twinfer eval kl`: score a reference and a candidate on the same token stream.

A SPEC is a twinfer backend (`llamacpp`, `torch`, `mlx`, options after a colon: `torch:kv=tq4`,
`mlx:kv=tq2.5,weights=int4`, `llamacpp:mode=fast`), `transformers`, or another model path. Runners come
from the `RunnerFactory` each function is handed: quant imports no backend."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from twinfer.quant.kl import KLAccumulator, KLReport
from twinfer.runtime.batch import LogitsWanted, SeqChunk, StepBatch
from twinfer.runtime.corpus import corpus_text
from twinfer.runtime.errors import TwinferError, require
from twinfer.runtime.model_path import resolve_path
from twinfer.runtime.runner import Runner
from twinfer.runtime.spec import ModelSpec

RUNNER_SPECS = ("llamacpp", "torch", "mlx")


class RunnerFactory(Protocol):
    """Where quant's measuring harness gets runners (the app's `RUNNERS`): `open` runs a model file on a
    backend, `build` runs in-memory weights on torch or MLX; both raise `TwinferError` when they cannot."""

    def open(self, model: str | None, backend: str, *, max_seqs: int, ctx: int, **options: Any) -> Runner: ...

    def build(self, backend: str, spec: ModelSpec, weights: Any, *, kv_tokens: int,
              kv_format: str | None = None) -> Runner: ...


class LogitSource(Protocol):
    """Teacher-forced logits for one window of tokens: [len(tokens), vocab] float32."""

    def logits(self, tokens: list[int]) -> np.ndarray: ...


class RunnerSource:
    """Any twinfer runner; each window is a fresh sequence at position 0."""

    def __init__(self, runner: Runner):
        self.runner = runner
        self._seq = 0

    def logits(self, tokens: list[int]) -> np.ndarray:
        bs = self.runner.kv.block_size
        table = list(range(-(-len(tokens) // bs)))
        self._seq += 1
        chunk = SeqChunk(self._seq, tokens, 0, table, LogitsWanted.ALL)
        try:
            return self.runner.step(StepBatch([chunk]))
        finally:
            self.runner.release(self._seq)


class TransformersSource:
    """Hugging Face transformers in fp32 on the same file (GGUF through transformers' own loader)."""

    def __init__(self, path: Path):
        require("the transformers reference", "torch", "transformers", "accelerate")
        import torch
        from transformers import AutoModelForCausalLM

        kwargs: dict[str, object] = {"dtype": torch.float32}
        if path.is_file():
            kwargs["gguf_file"] = path.name
            path = path.parent
        try:
            self.model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs).eval()
        except ValueError:  # a multimodal checkpoint (Kimi K2.5) has only the image-text class; text in, logits out
            from transformers import AutoModelForImageTextToText

            self.model = AutoModelForImageTextToText.from_pretrained(str(path), **kwargs).eval()
        self._torch = torch

    def logits(self, tokens: list[int]) -> np.ndarray:
        with self._torch.no_grad():
            out = self.model(self._torch.tensor([tokens])).logits[0]
        return out.float().numpy()


def open_source(spec: str, model: str | None, window: int, runners: RunnerFactory) -> LogitSource:
    if spec == "transformers":
        return TransformersSource(resolve_path(model))
    if spec in RUNNER_SPECS:
        return RunnerSource(runners.open(model, spec, max_seqs=2, ctx=_ctx_for(window)))
    path = Path(spec).expanduser()
    if path.exists():
        return RunnerSource(runners.open(str(path), "auto", max_seqs=2, ctx=_ctx_for(window)))
    backend, options = parse_spec(spec)
    return RunnerSource(runner_with_options(backend, options, model, _ctx_for(window), runners))


SPEC_OPTIONS = {"llamacpp": ("kv", "mode"), "torch": ("kv", "weights"), "mlx": ("kv", "weights")}


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """`torch:kv=tq4,weights=int4` -> ("torch", {"kv": "tq4", "weights": "int4"})."""
    backend, sep, rest = spec.partition(":")
    if backend not in RUNNER_SPECS or not sep:
        raise TwinferError(
            f"unknown SPEC {spec!r}: use llamacpp, torch, mlx, transformers, the path of a model, "
            "or BACKEND:key=value options (torch:kv=tq4, torch:weights=int4, llamacpp:kv=q4_0)"
        )
    options: dict[str, str] = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or key not in SPEC_OPTIONS[backend]:
            raise TwinferError(
                f"SPEC {spec!r}: option {item!r} is not one of {', '.join(k + '=...' for k in SPEC_OPTIONS[backend])}"
            )
        options[key] = value
    return backend, options


def runner_with_options(backend: str, options: dict[str, str], model: str | None, ctx: int,
                        runners: RunnerFactory) -> Runner:
    """A runner of `model` on `backend` with a quantized KV cache and/or uniformly quantized weights."""
    from twinfer.runtime.loaders import load_model

    if backend == "llamacpp":
        kv_type = options.get("kv", "f16")
        mode = {"mode": options["mode"]} if "mode" in options else {}
        try:
            return runners.open(model, "llamacpp", max_seqs=2, ctx=ctx, kv_type=kv_type, **mode)
        except ValueError as e:  # the runner names the cache types (and modes) it accepts
            raise TwinferError(f"{backend}:{','.join(f'{k}={v}' for k, v in options.items())}: {e}") from e
    loaded = load_model(resolve_path(model))
    from twinfer.quant.kv_format import parse_kv_format
    from twinfer.quant.model_io import QuantizedView, quantizable

    try:
        kv = options.get("kv")
        parse_kv_format(kv)
        weights: Any = loaded.weights
        if "weights" in options:
            fmt = options["weights"]
            weights = QuantizedView(weights, dict.fromkeys(quantizable(weights), fmt))
    except ValueError as e:
        raise TwinferError(f"{backend} SPEC options {options}: {e}") from e
    return runners.build(backend, loaded.spec, weights, kv_tokens=ctx, kv_format=kv)


def _ctx_for(window: int) -> int:
    return max(256, -(-(window + 1) // 256) * 256)


def corpus_windows(model: str | None, corpus: str, tokens: int, window: int) -> Iterator[list[int]]:
    """Windows of `window` tokens (BOS first where the model uses one) covering `tokens` tokens."""
    from twinfer.runtime.tokenizer import load_tokenizer

    if tokens < 1 or window < 2:
        raise TwinferError("--tokens must be >= 1 and --window >= 2")
    tokenizer = load_tokenizer(resolve_path(model))
    stream = tokenizer.encode(corpus_text(corpus, max_chars=tokens * 12 + 10_000), add_special_tokens=False)
    if len(stream) < tokens:
        raise TwinferError(f"corpus {corpus!r} has only {len(stream)} tokens, fewer than --tokens {tokens}")
    bos = [tokenizer.bos_id] if tokenizer.add_bos and tokenizer.bos_id is not None else []
    body = window - len(bos)
    for start in range(0, tokens, body):
        yield bos + stream[start : min(start + body, tokens)]


def measure_kl(model: str | None, reference: str, candidate: str, corpus: str, tokens: int,
               window: int = 256, *, runners: RunnerFactory) -> KLReport:
    """KL(reference || candidate) over `tokens` corpus tokens, scored in teacher-forced windows.

    Each scored row is a position whose next token is in the window (the last row is not scored)."""
    windows = list(corpus_windows(model, corpus, tokens, window))
    ref, cand = open_source(reference, model, window, runners), open_source(candidate, model, window, runners)
    acc = KLAccumulator()
    for tokens_w in windows:
        if len(tokens_w) > 1:
            acc.add(ref.logits(tokens_w)[:-1], cand.logits(tokens_w)[:-1], np.asarray(tokens_w[1:]))
    return acc.report(reference, candidate, str(corpus))
