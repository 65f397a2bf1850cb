"""Quantized model folders written by `twinfer quantize`: config.json + model.safetensors + tokenizer.
config.json holds the ModelSpec and `quantization_config` (`quant_method: "twinfer"`, per-tensor formats,
the measured KL); a quantized `NAME` is stored as `NAME.<part>`. `load` returns what the decoder that
`twinfer.quant.linear` registers makes of the parts, or the `PackedWeight` parts without one."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from twinfer.runtime.errors import ModelError, WeightError
from twinfer.runtime.loaders.safetensors_file import SafetensorsTensor, read_safetensors
from twinfer.runtime.loaders.weights import Region, Shape, WeightEntry, WeightSet
from twinfer.runtime.spec import MLASpec, ModelSpec, MoESpec

QUANT_METHOD = "twinfer"
WEIGHTS_FILE = "model.safetensors"
RAW_DTYPES: dict[str, str] = {
    "F32": "<f4", "F16": "<f2", "U8": "u1", "I8": "i1", "U16": "<u2", "I16": "<i2", "U32": "<u4",
    "I32": "<i4", "I64": "<i8",
}  # fmt: skip


@dataclass(frozen=True)
class PackedWeight:
    """A quantized weight as the folder stores it: its metadata (`format`, `shape`, ...) and named parts."""

    meta: dict[str, Any]
    arrays: dict[str, np.ndarray]


Decoder = Callable[[dict[str, Any], dict[str, np.ndarray]], Any]
_DECODERS: dict[str, Decoder] = {}


def register_decoder(method: str, decode: Decoder) -> None:
    """Let the layer that owns the formats turn stored parts into its weight objects (idempotent).
    Called once, at import, by `twinfer.quant.linear` for `quant_method` "twinfer"."""
    _DECODERS[method] = decode


def is_quantized_folder(folder: Path) -> bool:
    """Whether `folder`'s config.json says it was written by `twinfer quantize`."""
    config = folder / "config.json"
    if not config.is_file():
        return False
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    qc = data.get("quantization_config") if isinstance(data, dict) else None
    return isinstance(qc, dict) and qc.get("quant_method") == QUANT_METHOD


def spec_to_json(spec: ModelSpec) -> dict[str, Any]:
    return asdict(spec)


def spec_from_json(data: dict[str, Any]) -> ModelSpec:
    """Rebuild a ModelSpec from `spec_to_json` output (lists back to tuples, nested specs)."""
    d = dict(data)

    def frozen(v: Any) -> Any:
        return tuple(frozen(x) for x in v) if isinstance(v, list) else v

    for key in ("layer_types", "rope_scaling", "extra"):
        if d.get(key) is not None:
            d[key] = frozen(d[key])
    if d.get("moe") is not None:
        d["moe"] = MoESpec(**d["moe"])
    if d.get("mla") is not None:
        d["mla"] = MLASpec(**d["mla"])
    try:
        return ModelSpec(**d)
    except TypeError as e:
        raise ModelError(f"quantized model config has an unusable twinfer_spec ({e}); re-run twinfer quantize") from e


def read_raw(t: SafetensorsTensor) -> np.ndarray:
    """A stored tensor's values in their own dtype (integers included)."""
    if t.dtype not in RAW_DTYPES:
        raise WeightError(f"tensor {t.name!r} in {t.file} has unsupported dtype {t.dtype}")
    dt = np.dtype(RAW_DTYPES[t.dtype])
    raw = np.frombuffer(t.data, dtype=dt, count=t.nbytes // dt.itemsize, offset=t.offset)
    return raw.reshape(t.shape).copy()


class QuantizedWeightSet(WeightSet):
    """Weights of a quantized folder: `QuantizedWeight` for quantized names, float32 for the rest."""

    def __init__(self, spec: ModelSpec, stored: dict[str, SafetensorsTensor], tensors: dict[str, Any],
                 folder: Path) -> None:
        self._stored = stored
        self._qmeta = tensors
        self._parts: dict[str, dict[str, SafetensorsTensor]] = {name: {} for name in tensors}
        plain: dict[str, WeightEntry] = {}
        for key, t in stored.items():
            base, _, part = key.rpartition(".")
            if base in tensors:
                self._parts[base][part] = t
            else:
                plain[key] = WeightEntry((t,))
        missing = [n for n, parts in self._parts.items() if not parts]
        if missing:
            raise WeightError(f"{folder}: quantized tensor {missing[0]!r} has no stored parts; re-run twinfer quantize")
        entries = dict(plain)
        for name, parts in self._parts.items():
            entries[name] = WeightEntry(tuple(parts.values()))
        super().__init__(spec, entries)

    def load(self, name: str) -> Any:  # type: ignore[override]
        """float32 array; for a quantized tensor the registered decoder's object (a QuantizedWeight),
        or its `PackedWeight` parts when no decoder is registered."""
        if name not in self._qmeta:
            return super().load(name)
        arrays = {part: read_raw(t) for part, t in self._parts[name].items()}
        decode = _DECODERS.get(QUANT_METHOD)
        if decode is None:
            return PackedWeight(dict(self._qmeta[name]), arrays)
        try:
            return decode(self._qmeta[name], arrays)
        except (KeyError, ValueError) as e:
            raise WeightError(f"quantized tensor {name!r} cannot be rebuilt: {e}") from e

    def load_region(self, name: str, region: Region) -> np.ndarray:
        if name in self._qmeta:
            raise WeightError(f"quantized tensor {name!r} cannot be read in parts; shard the float model "
                              "instead, or run this quantized folder in one process")
        return super().load_region(name, region)

    def shape(self, name: str) -> Shape:
        if name in self._qmeta:
            return tuple(int(x) for x in self._qmeta[name]["shape"])
        return super().shape(name)

    def dtype_stored(self, name: str) -> str:
        if name in self._qmeta:
            return str(self._qmeta[name]["format"])
        return super().dtype_stored(name)

    def format_of(self, name: str) -> str | None:
        """The quantized format of `name`, or None when it is stored as floats."""
        meta = self._qmeta.get(name)
        return None if meta is None else str(meta["format"])


def load_quantized(folder: Path) -> tuple[ModelSpec, QuantizedWeightSet, dict[str, Any]]:
    """Read a quantized folder: (spec, weights, config)."""
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        qc = config["quantization_config"]
        spec = spec_from_json(config["twinfer_spec"])
        tensors = qc["tensors"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelError(f"{folder} is not a readable twinfer quantized folder ({e}); re-run twinfer quantize") from e
    path = folder / WEIGHTS_FILE
    if not path.is_file():
        raise ModelError(f"{folder} has no {WEIGHTS_FILE}; re-run twinfer quantize")
    stored = read_safetensors(path)
    weights = QuantizedWeightSet(spec, stored, tensors, folder)
    return spec, weights, config
