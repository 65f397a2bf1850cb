"""The stages `twinfer doctor` runs a model's tokens through, each compared with its `base`: lossless
stages keep greedy output (KL <= 1e-6 on the same arithmetic); others get their measured allowance."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from twinfer.quant.allowance import LLAMA_CPP_CPU
from twinfer.runtime.batch import LogitsWanted, SeqChunk, StepBatch
from twinfer.runtime.errors import TwinferError

FAULT_ENV = "TWINFER_DOCTOR_FAULT"  # "STAGE:LAYER": that stage runs with one layer's output perturbed (tests)


@dataclass(frozen=True)
class Allowance:
    """How far a stage may move from its base: mean KL, and whether greedy tokens must be identical."""

    max_kl: float | None  # None: not measured as KL (a generation stage)
    greedy: bool
    why: str


SAME_ARITHMETIC = Allowance(1e-6, True, "lossless, same fp32 arithmetic")
# the kernel floor `twinfer eval kl` judges endpoints by (quant/allowance.py), the same allowance over it
LLAMA_CPP = Allowance(LLAMA_CPP_CPU.allowance, False, f"llama.cpp quantizes activations in its matmuls: kernel floor "
                                                      f"{LLAMA_CPP_CPU.kl:g}, within kernel noise up to {LLAMA_CPP_CPU.allowance:.3g}")
GENERATION = Allowance(None, True, "lossless: greedy output identical")


@dataclass
class Stage:
    """One way of running the model. `logits(tokens)` or `generate(tokens)` does the work."""

    name: str
    base: str | None  # the stage it is compared with; None: the reference
    allowance: Allowance
    logits: Callable[[list[int]], np.ndarray] | None = None
    generate: Callable[[list[int]], list[int]] | None = None
    note: str = ""


def runner_logits(runner: Any) -> Callable[[list[int]], np.ndarray]:
    """Teacher-forced logits of a fresh sequence at position 0."""
    seq = [0]

    def run(tokens: list[int]) -> np.ndarray:
        seq[0] += 1
        table = list(range(-(-len(tokens) // runner.kv.block_size)))
        try:
            return np.asarray(runner.step(StepBatch([SeqChunk(seq[0], tokens, 0, table, LogitsWanted.ALL)])))
        finally:
            runner.release(seq[0])

    return run


def batched_logits(runner: Any) -> Callable[[list[int]], np.ndarray]:
    """The same tokens in one step with another sequence (the reversed tokens); this sequence's rows."""

    def run(tokens: list[int]) -> np.ndarray:
        bs = runner.kv.block_size
        n_blocks = -(-len(tokens) // bs)
        other = list(reversed(tokens))
        chunks = [SeqChunk(1001, other, 0, list(range(n_blocks, 2 * n_blocks)), LogitsWanted.LAST),
                  SeqChunk(1002, tokens, 0, list(range(n_blocks)), LogitsWanted.ALL)]
        try:
            return np.asarray(runner.step(StepBatch(chunks)))[1:]
        finally:
            runner.release(1001), runner.release(1002)

    return run


class PerturbedWeights(Mapping[str, Any]):
    """A model's weights with one layer's output projection scaled: an injected fault for the doctor's tests."""

    def __init__(self, weights: Any, layer: int, scale: float = 1.5):
        self.weights = weights
        names = list(weights.names())
        target = next((f"layers.{layer}.{p}" for p in ("o", "down", "attn.o", "mlp.down")
                       if f"layers.{layer}.{p}" in names), None)
        if target is None:
            raise TwinferError(f"{FAULT_ENV}: layer {layer} has no output projection to perturb")
        self.target, self.scale = target, scale

    def names(self) -> list[str]:
        return list(self.weights.names())

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.weights.shape(name))

    def load(self, name: str) -> Any:
        w = self.weights.load(name)
        return np.asarray(w, dtype=np.float32) * self.scale if name == self.target else w

    def __getitem__(self, name: str) -> Any:
        return self.load(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())


def fault_request() -> tuple[str, int] | None:
    """(stage, layer) from $TWINFER_DOCTOR_FAULT, or None."""
    value = os.environ.get(FAULT_ENV)
    if not value:
        return None
    stage, _, layer = value.rpartition(":")
    if not stage or not layer.isdigit():
        raise TwinferError(f"{FAULT_ENV}={value!r}: expected STAGE:LAYER, e.g. torch:1")
    return stage, int(layer)


def graph_runner(path: Path, backend: str, ctx: int, fault_layer: int | None) -> Any:
    """twinfer's own graph of `path` on torch or MLX in float32 (the weights dequantized from a GGUF)."""
    from twinfer.app.runners import RUNNERS
    from twinfer.runtime.loaders import load_model

    loaded = load_model(path)
    weights: Any = loaded.weights if fault_layer is None else PerturbedWeights(loaded.weights, fault_layer)
    return RUNNERS.build(backend, loaded.spec, weights, kv_tokens=ctx)


def available(backend: str) -> str | None:
    """None when `backend` can run here, else why not."""
    import importlib.util

    module = {"torch": "torch", "mlx": "mlx.core", "llamacpp": "llama_cpp", "transformers": "transformers"}[backend]
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    return None if found else f"{module} is not installed"
