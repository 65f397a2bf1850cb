"""GGUF files (llama.cpp): metadata -> ModelSpec, tensors -> WeightSet (dequantized on access).
Each architecture's file undoes its converter's conventions through its GGUF table and `gguf_spec`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from twinfer.runtime.errors import ModelError, UnsupportedArchitecture, WeightError
from twinfer.runtime.loaders.gguf_reader import GGUFContents, TensorInfo, ggml_type_name
from twinfer.runtime.loaders.names import map_weights
from twinfer.runtime.loaders.weights import FLOAT_STORAGE, Region, WeightSet, widen
from twinfer.runtime.models import GGUF_ARCHS, gguf_architecture, model_for
from twinfer.runtime.spec import ModelSpec, MoESpec

if TYPE_CHECKING:
    from twinfer.runtime.models.arch import Architecture


@dataclass(frozen=True)
class GGUFTensor:
    """A StoredTensor inside a GGUF file; `read` dequantizes with gguf-py's reference code."""

    name: str
    file: Path
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    info: TensorInfo
    contents: GGUFContents

    def read(self) -> np.ndarray:
        raw = self.contents.tensor_bytes(self.info)
        rows = int(np.prod(self.shape[:-1])) if len(self.shape) > 1 else 1
        values = self._dequantize(raw.reshape(rows, -1))
        # F32 comes back as a view of the read-only mapping: copy it; other types are fresh arrays.
        if self.dtype == "F32":
            return np.array(values, dtype=np.float32).reshape(self.shape)
        return np.asarray(values, dtype=np.float32).reshape(self.shape)

    def read_region(self, region: Region) -> np.ndarray:
        """`read()[region]` without reading what lies outside it, where the layout allows: float tensors are
        cut before converting, quantized ones read whole rows of blocks and cut columns after dequantizing."""
        raw = self.contents.tensor_bytes(self.info)
        if self.dtype in FLOAT_STORAGE:
            return widen(raw.view(FLOAT_STORAGE[self.dtype]).reshape(self.shape)[region], self.dtype)
        packed = raw.reshape(*self.shape[:-1], -1)[region[:-1]]  # [..rows.., bytes of one row]
        rows = self._dequantize(packed.reshape(-1, packed.shape[-1])).reshape(*packed.shape[:-1], self.shape[-1])
        return np.ascontiguousarray(rows[..., region[-1]], dtype=np.float32)

    def _dequantize(self, rows: np.ndarray) -> np.ndarray:
        """[rows, bytes of a row] stored bytes -> [rows, row length] values, with gguf-py's reference code."""
        from gguf.constants import GGMLQuantizationType
        from gguf.quants import dequantize

        try:
            return dequantize(rows, GGMLQuantizationType(self.info.ggml_type))
        except NotImplementedError as e:
            raise WeightError(
                f"tensor {self.name!r} in {self.file} is stored as {self.dtype}, which twinfer cannot "
                "dequantize; re-quantize the model to a K-quant, Q8_0 or a float type"
            ) from e


def read_gguf(path: Path) -> GGUFContents:
    return GGUFContents(path)


def load_gguf(path: Path) -> tuple[ModelSpec, WeightSet, dict[str, Any]]:
    """Parse `path`, derive its ModelSpec and map its tensors; returns (spec, weights, metadata)."""
    contents = read_gguf(path)
    spec = spec_from_gguf(contents)
    arch = _architecture(contents)
    table = arch.gguf_names
    assert table is not None  # _architecture refuses architectures without a GGUF table
    keys = GGUFKeys(contents.metadata, contents.metadata["general.architecture"], path)
    skip = arch.gguf_skip(keys, spec) if arch.gguf_skip is not None else ()
    stored = {
        name: GGUFTensor(name, path, info.shape, ggml_type_name(info.ggml_type), info.nbytes, info, contents)
        for name, info in contents.tensors.items()
    }
    weights = map_weights(spec, table, stored, str(path), model_for(spec).weight_shapes(), skip)
    return spec, weights, dict(contents.metadata)


def _architecture(contents: GGUFContents) -> Architecture:
    arch_name = contents.metadata.get("general.architecture")
    arch = gguf_architecture(arch_name)
    if arch is None or arch.gguf_names is None:
        known = ", ".join(sorted(GGUF_ARCHS))
        raise UnsupportedArchitecture(
            f"{contents.path}: GGUF architecture {arch_name!r} is not supported; twinfer reads {known}"
        )
    return arch


def spec_from_gguf(contents: GGUFContents) -> ModelSpec:
    """The ModelSpec described by a GGUF file's metadata (and, where metadata is silent, its tensors)."""
    arch = _architecture(contents)
    meta, path = contents.metadata, contents.path
    k = GGUFKeys(meta, meta["general.architecture"], path)
    tensors = contents.tensors
    hidden, n_heads = k.int("embedding_length"), k.int("attention.head_count")
    head_dim = k.int("attention.key_length", hidden // n_heads)
    embed = tensors.get("token_embd.weight")
    if embed is None:
        raise WeightError(f"missing tensor 'token_embd.weight' in {path}; the file is not a complete model")
    fields: dict[str, Any] = dict(
        model_type=arch.name,
        name=str(meta.get("general.name") or path.stem),
        vocab_size=embed.shape[0],
        hidden_size=hidden,
        num_layers=k.int("block_count"),
        num_heads=n_heads,
        num_kv_heads=k.int("attention.head_count_kv", n_heads),
        head_dim=head_dim,
        intermediate_size=k.int("feed_forward_length", 0),  # 0: MoE-only files (qwen35moe) write none
        max_position=k.int("context_length", 8192),
        rms_norm_eps=k.float("attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=k.float("rope.freq_base", 10000.0),
        rope_scaling=_rope_scaling(k),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        final_logit_softcap=k.float("final_logit_softcapping", 0.0) or None,
        moe=_moe(k),
    )
    if arch.gguf_spec is not None:
        fields = arch.gguf_spec(k, fields)
    # latent attention (MLA) stores its own key and value sizes; the architecture's hook reads them
    if fields.get("mla") is None and k.int("attention.value_length", head_dim) != fields["head_dim"]:
        raise UnsupportedArchitecture(f"{path}: key and value head sizes differ, which twinfer does not run")
    shared = k.int("expert_shared_count", 0)
    if shared and (fields["moe"] is None or fields["moe"].num_shared_experts != shared):
        raise UnsupportedArchitecture(f"{path}: shared experts are not supported for GGUF {k.arch!r}")
    return ModelSpec(**fields)


def _moe(k: GGUFKeys) -> MoESpec | None:
    expert_count = k.int("expert_count", 0)
    if not expert_count:
        return None
    return MoESpec(
        num_experts=expert_count,
        top_k=k.int("expert_used_count"),
        expert_intermediate_size=k.int("expert_feed_forward_length", 0) or k.int("feed_forward_length"),
        norm_topk_prob=bool(k.meta.get(f"{k.arch}.expert_weights_norm", True)),
    )


def _rope_scaling(k: GGUFKeys) -> tuple[tuple[str, Any], ...] | None:
    kind = k.meta.get(f"{k.arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    items: dict[str, Any] = {"rope_type": kind, "factor": k.float("rope.scaling.factor", 1.0)}
    original = k.int("rope.scaling.original_context_length", 0)
    if original:
        items["original_max_position_embeddings"] = original
    for key, name in (("rope.scaling.yarn_beta_fast", "beta_fast"), ("rope.scaling.yarn_beta_slow", "beta_slow")):
        if f"{k.arch}.{key}" in k.meta:
            items[name] = k.float(key)
    return tuple(sorted(items.items()))


class GGUFKeys:
    """Typed access to `{arch}.*` metadata with errors that name the file and key."""

    def __init__(self, meta: dict[str, Any], arch: str, path: Path) -> None:
        self.meta, self.arch, self.path = meta, arch, path

    def _get(self, key: str, default: Any) -> Any:
        full = f"{self.arch}.{key}"
        value = self.meta.get(full, default)
        if value is _MISSING:
            raise ModelError(f"{self.path}: GGUF metadata key {full!r} is missing; re-convert the model")
        if isinstance(value, list):  # per-layer values; twinfer needs them uniform
            if len(set(value)) != 1:
                raise UnsupportedArchitecture(f"{self.path}: {full!r} differs between layers: {value}")
            value = value[0]
        return value

    def int(self, key: str, default: Any = None) -> int:
        return int(self._get(key, _MISSING if default is None else default))

    def float(self, key: str, default: Any = None) -> float:
        # float32 metadata: print it back at float32 precision so 1e-6 stays 1e-6.
        return float(str(np.float32(self._get(key, _MISSING if default is None else default))))


_MISSING = object()
