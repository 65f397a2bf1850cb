"""Published pre-quantized safetensors layouts, loaded as published (no conversion step).
DeepSeek block FP8, compressed-tensors FP8/NVFP4/INT4/INT8, ModelOpt NVFP4/FP8, gpt-oss MXFP4 and
mlx-community affine, recognised from the config (docs/architecture.md, "Published quantized
checkpoints"). `Layout.pack` folds each linear's parts into one `PackedTensor` named `P.weight`;
activation scales are read past. An unknown method or option is refused, naming the config field."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from twinfer.formats.bitpack import unpack_nibbles
from twinfer.formats.e2m1 import decode_e2m1
from twinfer.formats.fp8 import decode_e4m3
from twinfer.runtime.errors import ModelError, WeightError
from twinfer.runtime.loaders.quantized import _DECODERS, PackedWeight
from twinfer.runtime.loaders.safetensors_file import SafetensorsTensor
from twinfer.runtime.loaders.weights import FLOAT_STORAGE, Region, Shape, WeightSet, widen

PUBLISHED = "published"  # the decoder key `twinfer.quant.linear` registers for these parts
MODELOPT_FILE = "hf_quant_config.json"
GENERIC_METHODS = ("fp8", "compressed-tensors", "modelopt")  # any architecture's table reads these
_RAW = {"U8": "u1", "F8_E4M3": "u1", "U32": "<u4", "I32": "<i4", "I8": "i1"}
EXPERT_TRANSFORMS = {"mxfp4_gate": 0, "mxfp4_up": 1, "mxfp4_experts": None}  # gpt_oss's, -> rows kept


class QuantConfigError(ModelError):
    """A published quantization config twinfer does not load (the message names the field)."""


def _refuse(fld: str, value: Any, supported: str) -> QuantConfigError:
    return QuantConfigError(f"config.json {fld}={value!r} is not supported; twinfer loads {supported}")


# -- reading the config ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    """How one folder's linears are stored: `method` and the options that shape the tensors."""

    method: str  # "fp8", "compressed-tensors", "modelopt", "mxfp4", "mlx"
    fp8_strategy: str = ""  # compressed-tensors FP8: "tensor", "channel" or "block"
    block: int = 128
    nvfp4: bool = False
    int_bits: int = 0  # compressed-tensors pack-quantized: symmetric int4/int8 in groups of `block`
    mlx: Mapping[str, Any] = field(default_factory=dict)  # `quantization`: group_size, bits, per-module overrides

    def mlx_options(self, module: str) -> tuple[int, int]:
        """(bits, group_size) of an mlx module (a per-module entry overrides the defaults)."""
        own = self.mlx.get(module)
        src = own if isinstance(own, dict) else self.mlx
        bits, group = src.get("bits", self.mlx.get("bits")), src.get("group_size", self.mlx.get("group_size"))
        where = f"quantization[{module!r}]" if isinstance(own, dict) else "quantization"
        if bits not in (4, 8):
            raise _refuse(f"{where}.bits", bits, "mlx affine int4 and int8")
        if group not in (32, 64, 128):
            raise _refuse(f"{where}.group_size", group, "mlx affine groups of 32, 64 or 128")
        return int(bits), int(group)


def read_layout(config: dict[str, Any], folder: Path | None, arch_methods: tuple[str, ...] = ()) -> Layout | None:
    """The folder's published layout, None for plain float weights; QuantConfigError for what it refuses."""
    mlx = config.get("quantization")
    qc = config.get("quantization_config")
    text = config.get("text_config")
    if qc is None and isinstance(text, dict):  # a multimodal wrapper's text model (Kimi K2.5)
        qc = text.get("quantization_config")
    if isinstance(mlx, dict):
        return _mlx(mlx)
    if qc is None and folder is not None and (folder / MODELOPT_FILE).is_file():
        qc = _modelopt_file(folder / MODELOPT_FILE)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise _refuse("quantization_config", qc, "a JSON object")
    method = qc.get("quant_method")
    if method is None and "bits" in qc and "group_size" in qc:  # mlx-lm also writes its options here
        return _mlx(qc)
    if method == "fp8":
        return _deepseek_fp8(qc)
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == "modelopt":
        return _modelopt(qc, "quantization_config")
    if method in arch_methods:
        return Layout(str(method))
    known = ", ".join(repr(m) for m in (*GENERIC_METHODS, *arch_methods))
    raise QuantConfigError(
        f"config.json quantization_config.quant_method={method!r} is not supported; twinfer loads {known}, "
        "mlx-community affine (quantization: {group_size, bits}) and folders written by twinfer quantize"
    )


def _mlx(q: dict[str, Any]) -> Layout:
    mode = q.get("mode", "affine")
    if mode != "affine":
        raise _refuse("quantization.mode", mode, "mlx affine int4/int8")
    layout = Layout("mlx", mlx=dict(q))
    layout.mlx_options("")  # the defaults must be valid
    return layout


def _deepseek_fp8(qc: dict[str, Any]) -> Layout:
    f = "quantization_config"
    if qc.get("fmt", "e4m3") != "e4m3":
        raise _refuse(f"{f}.fmt", qc.get("fmt"), "fp8 e4m3")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise _refuse(f"{f}.activation_scheme", qc.get("activation_scheme"), "dynamic activations")
    block = qc.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and block[0] == block[1] and int(block[0]) > 0):
        raise _refuse(f"{f}.weight_block_size", block, "square blocks such as [128, 128]")
    return Layout("fp8", block=int(block[0]))


def _compressed_tensors(qc: dict[str, Any]) -> Layout:
    f = "quantization_config"
    if qc.get("kv_cache_scheme") is not None:
        raise _refuse(f"{f}.kv_cache_scheme", qc["kv_cache_scheme"], "weights only (a float KV cache)")
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise _refuse(f"{f}.quantization_status", status, "compressed checkpoints")
    fmt = qc.get("format")
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise _refuse(f"{f}.config_groups", groups, "one or more quantization groups")
    kinds = set()
    for gname, group in groups.items():
        g = f"{f}.config_groups.{gname}"
        gfmt = group.get("format") or fmt
        w = group.get("weights") or {}
        fmt_field = f"{g}.format" if group.get("format") else f"{f}.format"
        if gfmt not in ("float-quantized", "nvfp4-pack-quantized", "pack-quantized"):
            raise _refuse(fmt_field, gfmt, "float-quantized (FP8), nvfp4-pack-quantized and pack-quantized (int)")
        if gfmt == "pack-quantized":
            kinds.add(_ct_int(w, g, fmt_field))
            continue
        if w.get("type") != "float":
            raise _refuse(f"{g}.weights.type", w.get("type"), "float weights")
        if not w.get("symmetric", True):
            raise _refuse(f"{g}.weights.symmetric", False, "symmetric weights")
        if w.get("dynamic", False):
            raise _refuse(f"{g}.weights.dynamic", True, "static weight scales")
        if gfmt == "nvfp4-pack-quantized":
            if (w.get("num_bits"), w.get("strategy"), w.get("group_size")) != (4, "tensor_group", 16):
                raise _refuse(f"{g}.weights", {k: w.get(k) for k in ("num_bits", "strategy", "group_size")},
                              "NVFP4 as num_bits 4, strategy tensor_group, group_size 16")
            kinds.add("nvfp4")
            continue
        if w.get("num_bits") != 8:
            raise _refuse(f"{g}.weights.num_bits", w.get("num_bits"), "8-bit float-quantized weights")
        strategy = w.get("strategy")
        if strategy not in ("tensor", "channel", "block"):
            raise _refuse(f"{g}.weights.strategy", strategy, "FP8 per tensor, per channel or in square blocks")
        if strategy == "block":
            bs = w.get("block_structure")
            if not (isinstance(bs, list) and len(bs) == 2 and bs[0] == bs[1]):
                raise _refuse(f"{g}.weights.block_structure", bs, "square FP8 blocks")
        kinds.add(f"fp8-{strategy}")
    if len(kinds) != 1:
        raise _refuse(f"{f}.config_groups", sorted(kinds), "one weight scheme per checkpoint")
    kind = kinds.pop()
    if kind == "nvfp4":
        return Layout("compressed-tensors", nvfp4=True)
    if kind.startswith("int"):
        bits, group = (int(x) for x in kind.removeprefix("int").split("-g"))
        return Layout("compressed-tensors", int_bits=bits, block=group)
    w = next(iter(groups.values()))["weights"]
    block = int((w.get("block_structure") or [128])[0])
    return Layout("compressed-tensors", fp8_strategy=kind.removeprefix("fp8-"), block=block)


def _ct_int(w: dict[str, Any], g: str, fmt_field: str) -> str:
    """The kind ("int4-g32") of a pack-quantized group's weights; refuses what MLX's affine layout cannot hold."""
    if w.get("type") != "int":
        raise _refuse(fmt_field, "pack-quantized", f"pack-quantized only for int weights, not {g}.weights.type="
                      f"{w.get('type')!r}")
    if w.get("num_bits") not in (4, 8):
        raise _refuse(f"{g}.weights.num_bits", w.get("num_bits"), "pack-quantized int4 and int8")
    if not w.get("symmetric", True):
        raise _refuse(f"{g}.weights.symmetric", False, "symmetric pack-quantized weights (no zero points)")
    if w.get("strategy") != "group" or w.get("group_size") not in (32, 64, 128):
        raise _refuse(f"{g}.weights", {k: w.get(k) for k in ("strategy", "group_size")},
                      "pack-quantized groups of 32, 64 or 128")
    if w.get("actorder") or w.get("dynamic", False):
        raise _refuse(f"{g}.weights.actorder", w.get("actorder"), "static groups in input order")
    return f"int{w['num_bits']}-g{w['group_size']}"


def _modelopt(qc: dict[str, Any], f: str) -> Layout:
    if qc.get("kv_cache_quant_algo") not in (None, "NONE"):
        raise _refuse(f"{f}.kv_cache_quant_algo", qc["kv_cache_quant_algo"], "weights only (a float KV cache)")
    algo = qc.get("quant_algo")
    if algo == "FP8":
        return Layout("modelopt", fp8_strategy="tensor")
    if algo != "NVFP4":
        raise _refuse(f"{f}.quant_algo", algo, "ModelOpt NVFP4 and FP8")
    if qc.get("group_size", 16) != 16:
        raise _refuse(f"{f}.group_size", qc.get("group_size"), "NVFP4 groups of 16")
    return Layout("modelopt", nvfp4=True)


def _modelopt_file(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        q = dict(data["quantization"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelError(f"cannot read {path} ({e}); fix or re-download it") from e
    return {"quant_method": "modelopt", **q}


# -- folding a linear's tensors into one -----------------------------------------------------------
def raw(t: SafetensorsTensor) -> np.ndarray:
    """A stored tensor's values in their own dtype (F8_E4M3 as uint8 codes), floats as float32."""
    if t.dtype in FLOAT_STORAGE:
        return widen(t.stored(), t.dtype)
    if t.dtype not in _RAW:
        raise WeightError(f"tensor {t.name!r} in {t.file} has dtype {t.dtype}, which no published layout uses")
    dt = np.dtype(_RAW[t.dtype])
    return np.frombuffer(t.data, dtype=dt, count=t.nbytes // dt.itemsize, offset=t.offset).reshape(t.shape)


@dataclass(frozen=True)
class PackedTensor:
    """One quantized linear of a published layout: a `StoredTensor` whose `read()` dequantizes; `fmt` is
    twinfer's format name, `parts` its fields' stored tensors (quant/linear.py), `meta` the scalars."""

    name: str
    fmt: str
    shape: Shape
    parts: tuple[tuple[str, SafetensorsTensor], ...]
    meta: tuple[tuple[str, Any], ...] = ()

    @property
    def file(self) -> Path:
        return self.parts[0][1].file

    @property
    def dtype(self) -> str:
        return self.fmt

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for _, t in self.parts)

    def arrays(self) -> dict[str, np.ndarray]:
        out = {k: raw(t) for k, t in self.parts}
        meta = dict(self.meta)
        if "offset" in meta:  # compressed-tensors' symmetric ints: unsigned codes minus a fixed offset
            out["wq"] = out["wq"].view(np.uint32)
            out["scales"] = out["scales"].astype(np.float32)
            out["biases"] = np.float32(-meta["offset"]) * out["scales"]
        if "scale" in out:  # FP8: one scale, or one per output row
            s = out["scale"].astype(np.float32)
            out["scale"] = s.reshape(-1, 1) if s.size > 1 else s.reshape(())
        if "global_scale" in out:
            g = out["global_scale"].astype(np.float32).reshape(())
            out["global_scale"] = np.float32(1.0) / g if meta.get("reciprocal") else g
        return out

    def packed(self) -> PackedWeight:
        meta = {k: v for k, v in self.meta if k != "reciprocal"}
        arrays = self.arrays()
        for k in [k for k, v in arrays.items() if v.ndim == 0]:  # scalars travel as metadata
            meta[k] = float(arrays.pop(k))
        return PackedWeight({"format": self.fmt, "shape": list(self.shape), **meta}, arrays)

    def read(self) -> np.ndarray:
        return dequantize(self.fmt, self.shape, self.arrays(), dict(self.meta))

    def read_region(self, region: Region) -> np.ndarray:
        return np.ascontiguousarray(self.read()[region])


# The layouts' companion tensors: suffix after the module path -> twinfer field (None: read past).
_FP8_DEEPSEEK: dict[str, str | None] = {"weight": "codes", "weight_scale_inv": "scale_inv"}
_FP8_CT: dict[str, str | None] = {"weight": "codes", "weight_scale": "scale", "input_scale": None}
_NVFP4_CT: dict[str, str | None] = {"weight_packed": "packed", "weight_scale": "scales", "weight_global_scale": "global_scale",
             "input_global_scale": None}
_NVFP4_MODELOPT: dict[str, str | None] = {"weight": "packed", "weight_scale": "scales", "weight_scale_2": "global_scale", "input_scale": None}
_MLX: dict[str, str | None] = {"weight": "wq", "scales": "scales", "biases": "biases"}
_INT_CT: dict[str, str | None] = {"weight_packed": "wq", "weight_scale": "scales", "weight_shape": None}


def _companions(layout: Layout) -> tuple[str, dict[str, str | None]]:
    """(the suffix that holds the values, the suffix -> field map) of the layout's quantized linears."""
    if layout.method == "fp8":
        return "weight_scale_inv", _FP8_DEEPSEEK
    if layout.method == "mlx":
        return "scales", _MLX
    if layout.int_bits:
        return "weight_packed", _INT_CT
    if layout.nvfp4:
        return ("weight_packed", _NVFP4_CT) if layout.method == "compressed-tensors" else ("weight_scale_2",
                                                                                           _NVFP4_MODELOPT)
    return "weight_scale", _FP8_CT


def pack(layout: Layout, stored: Mapping[str, SafetensorsTensor], origin: str) -> dict[str, Any]:
    """`stored` with each quantized linear's tensors folded into one `PackedTensor` named `P.weight`."""
    if layout.method == "mxfp4":
        return dict(stored)
    marker, fields = _companions(layout)
    out: dict[str, Any] = dict(stored)
    for name in [n for n in stored if n.endswith("." + marker)]:
        module = name[: -len(marker) - 1]
        parts: dict[str, SafetensorsTensor] = {}
        for suffix, fld in fields.items():
            t = out.pop(f"{module}.{suffix}", None)
            if t is not None and fld is not None:
                parts[fld] = t
            elif t is None and fld is not None:
                raise WeightError(f"missing tensor {module}.{suffix!s} (next to {name!r}) in {origin}")
        out[module + ".weight"] = _packed_tensor(layout, module, parts, origin)
    for name, t in out.items():
        if isinstance(t, SafetensorsTensor) and t.dtype == "F8_E4M3":
            raise WeightError(f"tensor {name!r} in {origin} is FP8 without a scale tensor next to it")
    return out


def _packed_tensor(layout: Layout, module: str, parts: dict[str, SafetensorsTensor], origin: str) -> PackedTensor:
    name = module + ".weight"
    if layout.method == "mlx":
        bits, group = layout.mlx_options(module)
        out, words = parts["wq"].shape
        shape = (out, words * 32 // bits)
        if parts["scales"].shape != (out, shape[1] // group):
            raise WeightError(f"tensor {module}.scales in {origin} has shape {parts['scales'].shape}, but "
                              f"{bits}-bit groups of {group} over {shape} need {(out, shape[1] // group)}")
        return PackedTensor(name, f"int{bits}", shape, tuple(parts.items()), (("bits", bits), ("group_size", group)))
    if layout.int_bits:
        return _ct_int_tensor(layout, module, parts, origin)
    if "packed" in parts:  # NVFP4
        out, half = parts["packed"].shape
        if parts["scales"].shape != (out, half * 2 // 16):
            raise WeightError(f"tensor {module} block scales in {origin} have shape {parts['scales'].shape}, "
                              f"expected {(out, half * 2 // 16)} (one per 16 weights)")
        reciprocal = layout.method == "compressed-tensors"
        return PackedTensor(name, "nvfp4", (out, half * 2), tuple(parts.items()), (("reciprocal", reciprocal),))
    rows, cols = parts["codes"].shape
    shape = (rows, cols)
    if parts["codes"].dtype != "F8_E4M3":
        raise WeightError(f"tensor {name!r} in {origin} is {parts['codes'].dtype}; this layout stores F8_E4M3")
    scale = parts.get("scale_inv") or parts.get("scale")
    assert scale is not None
    b = layout.block
    tiles = (-(-shape[0] // b), -(-shape[1] // b))
    if layout.method == "fp8" or layout.fp8_strategy == "block":
        if scale.shape != tiles:
            raise WeightError(f"scale of {name!r} in {origin} has shape {scale.shape}, expected {tiles} "
                              f"({b}x{b} blocks)")
        return PackedTensor(name, "fp8-block", shape, (("codes", parts["codes"]), ("scale_inv", scale)),
                            (("block", b),))
    size = int(np.prod(scale.shape))
    if size not in (1, shape[0]):
        raise WeightError(f"scale of {name!r} in {origin} has shape {scale.shape}: neither per tensor nor per channel")
    return PackedTensor(name, "fp8", shape, tuple(parts.items()))


def _ct_int_tensor(layout: Layout, module: str, parts: dict[str, SafetensorsTensor], origin: str) -> PackedTensor:
    """A compressed-tensors pack-quantized linear as twinfer's affine int4/int8 (MLX's bit order)."""
    bits, group = layout.int_bits, layout.block
    out, words = parts["wq"].shape
    shape = (out, words * 32 // bits)
    if parts["wq"].dtype not in ("I32", "U32") or parts["scales"].shape != (out, shape[1] // group):
        raise WeightError(f"tensor {module}.weight_packed / weight_scale in {origin} have {parts['wq'].dtype} "
                          f"{parts['wq'].shape} / {parts['scales'].shape}; {bits}-bit groups of {group} over "
                          f"{shape} need int32 words and scales {(out, shape[1] // group)}")
    meta = (("bits", bits), ("group_size", group), ("offset", 1 << (bits - 1)))
    return PackedTensor(module + ".weight", f"int{bits}", shape, tuple(parts.items()), meta)


# -- numpy dequantization (what float readers get) -------------------------------------------------
def dequantize(fmt: str, shape: Shape, a: dict[str, np.ndarray], meta: dict[str, Any]) -> np.ndarray:
    """float32 values of a packed linear (twinfer field names, see `PackedTensor.arrays`)."""
    out, inp = shape[-2], shape[-1]
    if fmt == "fp8":
        return decode_e4m3(a["codes"]) * a["scale"]
    if fmt == "fp8-block":
        b = int(meta["block"])
        s = np.repeat(np.repeat(a["scale_inv"], b, axis=0), b, axis=1)[:out, :inp]
        return decode_e4m3(a["codes"]) * s
    if fmt == "nvfp4":
        vals = decode_e2m1(unpack_nibbles(a["packed"]))  # [out, inp]
        scales = decode_e4m3(a["scales"]) * a["global_scale"]
        return (vals.reshape(out, -1, 16) * scales[..., None]).reshape(out, inp)
    if fmt in ("int4", "int8"):
        bits, group = int(meta["bits"]), int(meta["group_size"])
        shifts = np.arange(32 // bits, dtype=np.uint32) * bits
        q = ((a["wq"][..., None] >> shifts) & np.uint32((1 << bits) - 1)).reshape(out, inp // group, group)
        w = a["scales"][..., None] * q.astype(np.float32) + a["biases"][..., None]
        return w.reshape(out, inp).astype(np.float32)
    raise WeightError(f"no dequantization for format {fmt!r}")


# -- the weight set --------------------------------------------------------------------------------
class PublishedWeightSet(WeightSet):
    """A published checkpoint's weights. `weights[name]` gives packed linears (and gpt-oss's MXFP4
    experts) as the registered decoder's objects, so runners keep them in their format, and the rest
    as float32; `load(name)` always dequantizes to float32 (quantize, prune, sharded loads). Without a
    decoder (a runtime-only reader) both give float32."""

    @classmethod
    def of(cls, weights: WeightSet) -> PublishedWeightSet:
        return cls(weights.spec, weights._entries)

    def packed(self, name: str) -> PackedWeight | None:
        """The stored parts of `name` in twinfer's field names, or None when it is not kept packed."""
        entry = self._entry(name)
        if name == "embed":  # looked up by row, not multiplied: dequantized
            return None
        if entry.transform is None and isinstance(entry.sources[0], PackedTensor):
            return entry.sources[0].packed()
        if entry.transform == "stack_experts" and all(isinstance(s, PackedTensor) for s in entry.sources):
            each = [s.packed() for s in entry.sources if isinstance(s, PackedTensor)]
            shape = [len(each), *each[0].meta["shape"]]
            return PackedWeight({**each[0].meta, "shape": shape, "experts": [p.meta for p in each]},
                                {f"{e}.{k}": v for e, p in enumerate(each) for k, v in p.arrays.items()})
        if entry.transform in EXPERT_TRANSFORMS:  # gpt-oss MXFP4 experts [E, out, G, 16]
            rows = EXPERT_TRANSFORMS[entry.transform]
            blocks, scales = (np.asarray(raw(s)) for s in entry.sources)  # type: ignore[arg-type]
            if rows is not None:  # gate / up interleaved along the rows
                blocks, scales = blocks[:, rows::2], scales[:, rows::2]
            E, out, groups, _ = blocks.shape
            return PackedWeight({"format": "mxfp4", "shape": [E, out, groups * 32]},
                                {"blocks": np.ascontiguousarray(blocks), "scales": np.ascontiguousarray(scales)})
        return None

    def __getitem__(self, name: str) -> Any:  # type: ignore[override]
        """What a runner holds: the decoder's packed object where the weight stays in its format,
        else `load(name)`. (`load` itself is always float32, for readers that transform weights.)"""
        decode = _DECODERS.get(PUBLISHED)
        packed = self.packed(name) if decode is not None else None
        if packed is None or decode is None:
            return super().load(name)
        try:
            return decode(packed.meta, packed.arrays)
        except (KeyError, ValueError) as e:
            raise WeightError(f"published quantized tensor {name!r} cannot be rebuilt: {e}") from e

    def format_of(self, name: str) -> str | None:
        """The published format `name` stays in, or None for a weight loaded as float32."""
        entry = self._entry(name)
        if entry.transform in EXPERT_TRANSFORMS:
            return "mxfp4"
        kept = name != "embed" and entry.transform in (None, "stack_experts")
        src = entry.sources[0]
        return src.fmt if kept and isinstance(src, PackedTensor) and all(
            isinstance(s, PackedTensor) for s in entry.sources) else None
