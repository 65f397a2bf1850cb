"""Random-weight checkpoints written tensor by tensor (bounded memory), for tests and benchmarks of
large models; `greedy_tokens` decodes straight through a runner without a tokenizer."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import numpy as np

from twinfer.runtime.batch import SeqChunk, StepBatch
from twinfer.runtime.models.qwen3_moe import SyntheticMoE
from twinfer.runtime.runner import Runner

__all__ = ["SyntheticMoE", "SyntheticShape", "greedy_tokens", "write_synthetic_moe"]


class SyntheticShape(Protocol):
    """What the writer needs of an architecture's synthetic shape (`qwen3_moe.SyntheticMoE`, the tests'
    `SyntheticGptOss`): its config.json and, per layer, (name, shape, std) of its tensors."""

    @property
    def hidden(self) -> int: ...
    @property
    def layers(self) -> int: ...
    @property
    def vocab(self) -> int: ...
    @property
    def dtype(self) -> str: ...

    def config(self) -> dict[str, object]: ...

    def layer_tensors(self, i: int) -> Iterator[tuple[str, tuple[int, ...], float]]: ...


def _values(shape: tuple[int, ...], std: float, seed: int, index: int, dtype: str) -> np.ndarray:
    rng = np.random.default_rng([seed, index])
    if std == 0.0:
        x = 1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)
    else:
        x = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
    if dtype == "BF16":  # round to nearest even, keep the top half
        bits = x.view(np.uint32)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return x


def _write_shard(path: Path, tensors: list[tuple[str, tuple[int, ...], float, int]], seed: int, dtype: str) -> None:
    item = 4 if dtype == "F32" else 2
    header: dict[str, object] = {}
    offset = 0
    for name, shape, _, _ in tensors:
        size = int(np.prod(shape)) * item
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _, shape, std, index in tensors:
            f.write(_values(shape, std, seed, index, dtype).tobytes())


def write_synthetic_moe(folder: Path, shape: SyntheticShape | None = None, seed: int = 0) -> Path:
    """Write a random checkpoint of `shape` (default: `SyntheticMoE()`, a Qwen3-MoE) into `folder` (one
    shard per layer); returns the folder."""
    shape = shape if shape is not None else SyntheticMoE()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(shape.config(), indent=1))
    C, V = shape.hidden, shape.vocab
    shards: list[list[tuple[str, tuple[int, ...], float]]] = [
        [("model.embed_tokens.weight", (V, C), 1.0), ("model.norm.weight", (C,), 0.0),
         ("lm_head.weight", (V, C), 4 * C**-0.5)]
    ]
    shards += [list(shape.layer_tensors(i)) for i in range(shape.layers)]
    weight_map: dict[str, str] = {}
    index = 0
    for k, tensors in enumerate(shards):
        name = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        numbered = []
        for t in tensors:
            numbered.append((*t, index))
            weight_map[t[0]] = name
            index += 1
        _write_shard(folder / name, numbered, seed, shape.dtype)
    index_json = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index_json))
    return folder


def greedy_tokens(runner: Runner, prompt: list[int], steps: int, seq_id: int = 1) -> list[int]:
    """Prefill `prompt`, then decode `steps` tokens greedily; returns the generated ids."""
    bs = runner.kv.block_size
    total = len(prompt) + steps
    table = list(range(-(-total // bs)))
    out: list[int] = []
    chunk = SeqChunk(seq_id, list(prompt), 0, table)
    for _ in range(steps):
        logits = runner.step(StepBatch([chunk]))
        nxt = int(np.argmax(logits[-1]))
        out.append(nxt)
        chunk = SeqChunk(seq_id, [nxt], chunk.end, table)
    runner.release(seq_id)
    return out
