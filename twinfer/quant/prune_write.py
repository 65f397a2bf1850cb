"""Write a pruned model in the format it came in, copying the kept tensors' stored bytes unchanged.
GGUF: kept blocks renumbered, per-layer metadata follows, the sliding/full pattern written per layer.
Hugging Face folders: renumbered shards, config.json with the new counts and explicit `layer_types`."""

from __future__ import annotations

import json
import re
import shutil
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from twinfer.quant.gguf_rewrite import ARRAY, SKIP, TypedGGUF, rewrite_gguf
from twinfer.runtime.errors import TwinferError
from twinfer.runtime.loaders.hf import INDEX_FILE, read_config, spec_from_config, stored_tensors
from twinfer.runtime.loaders.safetensors_file import SafetensorsTensor
from twinfer.runtime.spec import SLIDING, ModelSpec

_BOOL = 7  # GGUF value type of a bool

_LAYER = re.compile(r"^(.*?\blayers\.|blk\.)(\d+)\.(.*)$")
_EXPERT = re.compile(r"^(.*\bexperts\.|ffn_(?:gate|up|down)\.)(\d+)(\..*|)$")
_STACKED = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_inp",
            "mlp.gate.weight", "block_sparse_moe.gate.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def _rename(name: str, layer_map: dict[int, int], keep_experts: dict[int, list[int]]) -> tuple[str, list[int] | None] | None:
    """(new name, expert rows to keep of a stacked tensor or None), or None to drop the tensor."""
    m = _LAYER.match(name)
    if m is None:
        return name, None
    old = int(m[2])
    if old not in layer_map:
        return None
    rest = m[3]
    keep = keep_experts.get(old)
    rows = None
    if keep is not None:
        e = _EXPERT.match(rest)
        if e is not None:  # one tensor per expert: drop or renumber
            if int(e[2]) not in keep:
                return None
            rest = f"{e[1]}{keep.index(int(e[2]))}{e[3]}"
        elif any(rest.startswith(s) for s in _STACKED):
            rows = keep
    return f"{m[1]}{layer_map[old]}.{rest}", rows


def write_pruned_gguf(src: Path, out: Path, spec: ModelSpec, keep_layers: Sequence[int],
                      keep_experts: dict[int, list[int]] | None = None) -> Path:
    """Copy `src` to `out` with only `keep_layers` (and, per MoE layer, `keep_experts`)."""
    keep_experts = keep_experts or {}
    contents = TypedGGUF(src)
    arch = str(contents.metadata["general.architecture"])
    layer_map = {old: new for new, old in enumerate(keep_layers)}
    n_old = spec.num_layers
    pattern_key = f"{arch}.attention.sliding_window_pattern"

    def value(key: str, v: Any) -> Any:
        if key == pattern_key:
            return SKIP  # rewritten below from the kept layers' types
        if key == f"{arch}.block_count":
            return len(keep_layers)
        if key == f"{arch}.expert_count" and keep_experts:
            return len(next(iter(keep_experts.values())))
        if key.startswith(f"{arch}.") and isinstance(v, list) and len(v) == n_old:
            return [v[i] for i in keep_layers]  # per-layer metadata
        return v

    def tensor(name: str, raw: np.ndarray, ggml_type: int) -> tuple[str, np.ndarray, int] | None:
        renamed = _rename(name, layer_map, keep_experts)
        if renamed is None:
            return None
        new_name, rows = renamed
        return new_name, raw if rows is None else raw[rows], ggml_type

    extra = []
    if len(set(spec.attention_types)) > 1:  # mixed sliding and full layers: the default pattern moved
        extra.append((pattern_key, [spec.attention_types[i] == SLIDING for i in keep_layers], ARRAY, _BOOL))
    return rewrite_gguf(contents, out, values=value, extra=extra, tensors=tensor)


def _stored_bytes(t: SafetensorsTensor, rows: list[int] | None) -> tuple[bytes, list[int]]:
    raw = np.frombuffer(t.data, dtype=np.uint8, count=t.nbytes, offset=t.offset)
    if rows is None:
        return raw.tobytes(), list(t.shape)
    per_row = raw.reshape(t.shape[0], -1)
    return per_row[rows].tobytes(), [len(rows), *t.shape[1:]]


def _write_shard(path: Path, items: list[tuple[str, str, list[int], bytes]]) -> None:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape, data in items:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for *_, data in items:
            f.write(data)


def _pruned_config(config: dict[str, Any], spec: ModelSpec, keep_layers: Sequence[int], n_experts: int | None) -> dict[str, Any]:
    out = json.loads(json.dumps(config))
    text = out["text_config"] if isinstance(out.get("text_config"), dict) else out
    text["num_hidden_layers"] = len(keep_layers)
    text["layer_types"] = [spec.attention_types[i] for i in keep_layers]
    text.pop("max_window_layers", None) if SLIDING not in spec.attention_types else None
    if n_experts is not None:
        for key in ("num_experts", "num_local_experts"):
            if key in text or key == "num_experts":
                text[key] = n_experts
    return out


def write_pruned_hf(src: Path, out: Path, keep_layers: Sequence[int],
                    keep_experts: dict[int, list[int]] | None = None, shard_bytes: int = 2 << 30) -> Path:
    """Copy the Hugging Face folder `src` to the folder `out` with only the kept layers and experts."""
    keep_experts = keep_experts or {}
    if out.resolve() == src.resolve():
        raise TwinferError(f"--out {out} is the model itself; write the pruned model somewhere else")
    config = read_config(src)
    spec = spec_from_config(config, name=src.name)
    out.mkdir(parents=True, exist_ok=True)
    layer_map = {old: new for new, old in enumerate(keep_layers)}
    shards: list[list[tuple[str, str, list[int], bytes]]] = [[]]
    size = 0
    for name, t in stored_tensors(src).items():
        renamed = _rename(name, layer_map, keep_experts)
        if renamed is None:
            continue
        new, rows = renamed
        data, shape = _stored_bytes(t, rows)
        if size and size + len(data) > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((new, t.dtype, shape, data))
        size += len(data)
    weight_map = {}
    for k, items in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        _write_shard(out / fname, items)
        weight_map.update({name: fname for name, *_ in items})
    (out / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    n_experts = len(next(iter(keep_experts.values()))) if keep_experts else None
    (out / "config.json").write_text(json.dumps(_pruned_config(config, spec, keep_layers, n_experts), indent=1))
    for extra in src.iterdir():
        if extra.is_file() and extra.suffix != ".safetensors" and extra.name not in ("config.json", INDEX_FILE):
            shutil.copy2(extra, out / extra.name)
    return out
