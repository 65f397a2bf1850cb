"""Quantized weights and the TurboQuant KV cache over torch.
Affine and TurboQuant weights dequantize inside each matmul; fp8/nvfp4/mxfp4 dequantize once at load
locally, or stay packed on a GPU plan (`TorchPackedLinear`, `TorchPackedExperts`). `TorchTQKV` stores
bit-packed codes and float16 norms and attends in the rotated domain (docs/quantization.md, "Layouts")."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from twinfer.formats.bitpack import code_group, packed_width
from twinfer.formats.e2m1 import E2M1_VALUES
from twinfer.quant.kv_format import ChannelSet, KVFormat, mse_sets, qjl_sketch
from twinfer.quant.linear import QuantizedExperts, QuantizedWeight, tq_linear_parts


class TorchAffineLinear:
    """Affine int weight (MLX layout): codes uint8 [out, in], scales/biases [out, in / g]."""

    def __init__(self, qw: QuantizedWeight, device: torch.device, dtype: torch.dtype):
        p = qw.packed
        self.shape = qw.shape
        self.group = int(p.group_size)
        self.codes = torch.from_numpy(p.codes()).to(device)
        self.scales = torch.from_numpy(p.scales).to(device, dtype)
        self.biases = torch.from_numpy(p.biases).to(device, dtype)

    def dense(self) -> torch.Tensor:
        out, inp = self.shape
        q = self.codes.view(out, inp // self.group, self.group).to(self.scales.dtype)
        return (q * self.scales[..., None] + self.biases[..., None]).view(out, inp)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, self.dense(), bias)


class TorchTQLinear:
    """TurboQuant weight: activations rotated per input block, weight decoded by codebook lookup."""

    def __init__(self, qw: QuantizedWeight, device: torch.device, dtype: torch.dtype):
        parts = tq_linear_parts(qw.packed)
        self.shape, self.block = parts.shape, parts.block

        def t(a: np.ndarray, dt: torch.dtype | None = None) -> torch.Tensor:
            return torch.from_numpy(np.array(a, copy=True)).to(device, dt)

        self.channels = [t(c) for c in parts.channels]  # [G, d_s]
        self.rotation = [t(r, dtype) for r in parts.rotation]  # [D_s, d_s]
        self.codes = [t(c) for c in parts.codes]  # uint8 [out, G, D_s]
        self.scales = [t(s, dtype) for s in parts.scales]  # [out, G]
        self.centroids = [t(c, dtype) for c in parts.centroids]

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out, inp = self.shape
        lead = x.shape[:-1]
        G = inp // self.block
        xb = x.reshape(-1, G, self.block)  # [M, G, block]
        y = None
        for idx, rot, codes, scale, cent in zip(
            self.channels, self.rotation, self.codes, self.scales, self.centroids, strict=True
        ):
            xs = torch.gather(xb, 2, idx[None].expand(xb.shape[0], -1, -1))  # [M, G, d_s]
            xr = xs @ rot.T  # [M, G, D_s]
            wr = cent[codes.long()] * scale[..., None]  # [out, G, D_s]: the codebook lookup
            part = xr.reshape(xr.shape[0], -1) @ wr.reshape(out, -1).T  # [M, out]
            y = part if y is None else y + part
        assert y is not None
        if bias is not None:
            y = y + bias
        return y.reshape(*lead, out)


def _tensor(a: Any, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.array(a, copy=True)).to(device)  # a copy: published parts are file views


_FP4 = torch.from_numpy(E2M1_VALUES.copy())


def fp4_values(packed: torch.Tensor) -> torch.Tensor:
    """E2M1 pairs uint8 [..., n/2] (even element in the low nibble) -> float32 [..., n]."""
    lut = _FP4.to(packed.device)
    return torch.stack((lut[(packed & 0x0F).long()], lut[(packed >> 4).long()]), dim=-1).flatten(-2)


class TorchPackedLinear:
    """A published FP8 / NVFP4 / MXFP4 weight kept packed on the device (the datacenter target): `dense()`
    rebuilds it; matmuls without a native kernel dequantize on the fly; FP8 runs `torch._scaled_mm`."""

    def __init__(self, qw: QuantizedWeight, device: torch.device, dtype: torch.dtype):
        p, self.fmt, self.shape, self.dtype = qw.packed, qw.fmt, qw.shape, dtype
        self.parts: dict[str, torch.Tensor] = {}
        self.block = int(getattr(p, "block", 0))
        if qw.fmt == "fp8":
            scale = np.asarray(p.scale, dtype=np.float32).reshape(-1, 1)  # [1, 1] or [out, 1]
            self.parts = {"codes": _tensor(p.codes, device).view(torch.float8_e4m3fn), "scale": _tensor(scale, device)}
        elif qw.fmt == "fp8-block":
            self.parts = {"codes": _tensor(p.codes, device).view(torch.float8_e4m3fn),
                          "scale_inv": _tensor(p.scale_inv, device)}
        elif qw.fmt == "nvfp4":
            self.parts = {"packed": _tensor(p.packed, device), "scales": _tensor(p.scales, device).view(torch.float8_e4m3fn),
                          "global_scale": _tensor(np.float32(p.global_scale), device)}
        elif qw.fmt == "mxfp4":
            self.parts = {"blocks": _tensor(p.blocks, device), "scales": _tensor(p.scales, device)}
        else:
            raise ValueError(f"{qw.fmt} is not a packed float format")

    @property
    def nbytes(self) -> int:
        """Device bytes the weight holds (its packed parts)."""
        return sum(int(t.nbytes) for t in self.parts.values())

    def dense(self) -> torch.Tensor:
        out, inp = self.shape
        t = self.parts
        if self.fmt == "fp8":
            w = t["codes"].float() * t["scale"]
        elif self.fmt == "fp8-block":
            b = self.block
            w = t["codes"].float() * t["scale_inv"].repeat_interleave(b, 0).repeat_interleave(b, 1)[:out, :inp]
        elif self.fmt == "nvfp4":
            vals = fp4_values(t["packed"]).view(out, inp // 16, 16)  # [out, blocks, 16]
            w = (vals * (t["scales"].float() * t["global_scale"])[..., None]).view(out, inp)
        else:  # mxfp4: E8M0 scale 2**(code - 127)
            vals = fp4_values(t["blocks"])  # [out, G, 32]
            w = (vals * torch.exp2(t["scales"].float() - 127)[..., None]).view(out, inp)
        return w.to(self.dtype)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        from twinfer.backends.cuda.formats import fp8_supported, quantize_rows

        out, inp = self.shape
        if self.fmt == "fp8" and fp8_supported(x.device) and inp % 16 == 0 and out % 16 == 0:
            xq, xs = quantize_rows(x.reshape(-1, inp))
            scale = self.parts["scale"].expand(out, 1).contiguous()
            y = torch._scaled_mm(xq, self.parts["codes"].t(), scale_a=xs, scale_b=scale.t(), out_dtype=torch.bfloat16)
            y = y.to(x.dtype).reshape(*x.shape[:-1], out)
            return y if bias is None else y + bias
        return F.linear(x, self.dense().to(x.dtype), bias)


class TorchPackedExperts:
    """Stacked experts [E, out, in] kept packed, one `TorchPackedLinear` each; `experts[e]` is expert
    e dequantized for its matmul (what TorchOps.experts' loop indexes)."""

    def __init__(self, qe: QuantizedExperts, device: torch.device, dtype: torch.dtype):
        self.fmt, self.shape = qe.fmt, qe.shape
        self.experts = [TorchPackedLinear(e, device, dtype) for e in qe.experts]

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.experts)

    def __getitem__(self, e: int) -> torch.Tensor:
        return self.experts[e].dense()


PACKED_FLOAT = ("fp8", "fp8-block", "nvfp4", "mxfp4")


def torch_weight(qw: QuantizedWeight | QuantizedExperts, device: torch.device, dtype: torch.dtype,
                 packed: bool = False) -> Any:
    """The torch form of a quantized weight: a callable linear, or a dense tensor. `packed` keeps the
    float formats (fp8, fp8-block, nvfp4, mxfp4) in their bytes (the datacenter target); otherwise they
    are dequantized once here, the local rule, as are stacked experts of the integer formats."""
    if packed and qw.fmt in PACKED_FLOAT and device.type == "cuda":  # the datacenter serves native formats only
        from twinfer.backends.cuda.formats import check_format

        check_format("fp8" if qw.fmt == "fp8-block" else qw.fmt, torch.cuda.get_device_capability(device))
    if isinstance(qw, QuantizedExperts):
        if packed and qw.fmt in PACKED_FLOAT:
            return TorchPackedExperts(qw, device, dtype)
        return torch.from_numpy(qw.dequantize()).to(device, dtype)
    if qw.fmt in ("int8", "int4"):
        return TorchAffineLinear(qw, device, dtype)
    if qw.fmt.startswith("tq"):
        return TorchTQLinear(qw, device, dtype)
    if packed and qw.fmt in PACKED_FLOAT:
        return TorchPackedLinear(qw, device, dtype)
    return torch.from_numpy(qw.dequantize()).to(device, dtype)


# -- KV cache --------------------------------------------------------------------------------------
class TorchCodePacking:
    """Rows of `n` codes of `bits` bits <-> uint8 `[..., packed_width(n, bits)]` (formats/bitpack.py's
    layout), a run of `code_group` codes per little-endian word."""

    def __init__(self, bits: int, n: int, device: torch.device):
        self.bits, self.n = bits, n
        self.group, self.word_bytes = code_group(bits)
        self.width = packed_width(n, bits)
        self.word = torch.int32 if self.word_bytes <= 3 else torch.int64
        self.code_shifts = torch.arange(self.group, device=device, dtype=self.word) * bits  # [G]
        self.byte_shifts = torch.arange(self.word_bytes, device=device, dtype=self.word) * 8  # [W]

    def pack(self, codes: torch.Tensor) -> torch.Tensor:
        """uint8 codes [..., n] (each < 2**bits) -> uint8 [..., width]."""
        lead = codes.shape[:-1]
        runs = F.pad(codes, (0, -self.n % self.group)).reshape(*lead, -1, self.group)  # [..., n/G, G]
        runs = runs.to(self.word)
        words = (runs << self.code_shifts).sum(-1, dtype=self.word)  # disjoint bit ranges: the sum is an OR
        return ((words[..., None] >> self.byte_shifts) & 0xFF).to(torch.uint8).reshape(*lead, self.width)

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """uint8 [..., width] -> uint8 codes [..., n]."""
        lead = packed.shape[:-1]
        runs = packed.reshape(*lead, -1, self.word_bytes).to(self.word)  # [..., n/G, W]
        words = (runs << self.byte_shifts).sum(-1, dtype=self.word)
        codes = (words[..., None] >> self.code_shifts) & ((1 << self.bits) - 1)  # [..., n/G, G]
        return codes.reshape(*lead, -1)[..., : self.n].to(torch.uint8)


class _CodedSets:
    """One side (keys or values) of a layer's cache under TurboQuant-MSE channel sets."""

    def __init__(self, sets: tuple[ChannelSet, ...], slots: int, heads: int, head_dim: int,
                 device: torch.device, dtype: torch.dtype, centered: bool = False):
        self.sets = sets
        self.centered = centered
        self.mean: torch.Tensor | None = None  # [Hkv, D], fixed at the first write when centered
        self.heads, self.head_dim, self.dtype = heads, head_dim, dtype
        self.rot = [torch.from_numpy(s.rotation).to(device, dtype) for s in sets]  # [D_s, d_s]
        self.cent = [torch.from_numpy(s.centroids).to(device, dtype) for s in sets]
        self.bounds = [torch.from_numpy(s.boundaries).to(device, dtype) for s in sets]
        self.packing = [TorchCodePacking(s.bits, s.padded_dim, device) for s in sets]
        self.codes = [torch.zeros((slots, heads, p.width), dtype=torch.uint8, device=device)
                      for p in self.packing]  # [slots, Hkv, packed D_s]
        self.norms = [torch.zeros((slots, heads), dtype=torch.float16, device=device) for _ in sets]
        self.channels: list[torch.Tensor] | None = None  # [Hkv, d_s] per set, fixed at the first write
        if len(sets) == 1:
            self.channels = [torch.arange(head_dim, device=device).expand(heads, head_dim)]

    def _calibrate(self, x: torch.Tensor) -> None:
        if len(self.sets) == 1:
            return
        rms = x.float().pow(2).mean(0)  # [Hkv, D]
        order = torch.argsort(rms, dim=-1, descending=True, stable=True)
        n_hi = self.sets[0].dim
        self.channels = [order[:, :n_hi].sort(-1).values, order[:, n_hi:].sort(-1).values]

    def write(self, x: torch.Tensor, slots: torch.Tensor) -> None:
        """Code x [T, Hkv, D] into the given cache slots."""
        if self.centered:
            if self.mean is None:
                self.mean = x.to(self.dtype).mean(0)
            x = x.to(self.dtype) - self.mean
        if self.channels is None:
            self._calibrate(x)
        assert self.channels is not None
        T = x.shape[0]
        for i, s in enumerate(self.sets):
            xs = torch.gather(x.to(self.dtype), 2, self.channels[i][None].expand(T, -1, -1))  # [T, Hkv, d_s]
            norm = xs.float().norm(dim=-1)  # [T, Hkv]
            unit = xs / torch.where(norm > 0, norm, 1.0)[..., None].to(xs.dtype)
            z = (unit @ self.rot[i].T) * math.sqrt(s.padded_dim)  # [T, Hkv, D_s]
            codes = torch.bucketize(z, self.bounds[i]).to(torch.uint8)
            self.codes[i].index_copy_(0, slots, self.packing[i].pack(codes))
            self.norms[i].index_copy_(0, slots, norm.to(torch.float16))

    def rotated(self, kv_slots: torch.Tensor) -> torch.Tensor:
        """Decoded vectors of the gathered slots in the rotated domain: [B, L, Hkv, sum D_s]."""
        out = []
        for i, s in enumerate(self.sets):
            scale = self.norms[i][kv_slots].to(self.dtype) / math.sqrt(s.padded_dim)  # [B, L, Hkv]
            codes = self.packing[i].unpack(self.codes[i][kv_slots])  # [B, L, Hkv, D_s]
            out.append(self.cent[i][codes.long()] * scale[..., None])
        return torch.cat(out, dim=-1)

    @property
    def nbytes(self) -> int:
        """Bytes of the cache tensors (and the centered format's per-layer mean, once taken)."""
        held = [*self.codes, *self.norms, *([self.mean] if self.mean is not None else [])]
        return sum(t.nbytes for t in held)

    def rotate_queries(self, q: torch.Tensor, group: int) -> torch.Tensor:
        """Queries [..., H, D] into the rotated domain of their KV head: [..., H, sum D_s]."""
        assert self.channels is not None
        out = []
        for i in range(len(self.sets)):
            idx = self.channels[i].repeat_interleave(group, dim=0)  # [H, d_s]
            qs = torch.gather(q, -1, idx.expand(*q.shape[:-1], -1))
            out.append(qs @ self.rot[i].T)
        return torch.cat(out, dim=-1)

    def unrotate(self, y: torch.Tensor, group: int) -> torch.Tensor:
        """Rotated-domain outputs [..., H, sum D_s] back to [..., H, D] (each set to its channels)."""
        assert self.channels is not None
        out = torch.zeros((*y.shape[:-1], self.head_dim), dtype=y.dtype, device=y.device)
        start = 0
        for i, s in enumerate(self.sets):
            piece = y[..., start : start + s.padded_dim] @ self.rot[i]  # [..., H, d_s]
            start += s.padded_dim
            idx = self.channels[i].repeat_interleave(group, dim=0)
            out.scatter_(-1, idx.expand(*y.shape[:-1], -1), piece)
        if self.mean is not None:  # attention weights sum to 1, so the value mean comes back whole
            out = out + self.mean.repeat_interleave(group, dim=0)
        return out


class _QJLKeys:
    """Keys under TurboQuant-prod: (bits - 1)-bit MSE codes plus a 1-bit QJL sketch of the residual."""

    def __init__(self, bits: int, slots: int, heads: int, head_dim: int, seed: int,
                 device: torch.device, dtype: torch.dtype):
        self.mse = _CodedSets(mse_sets(bits - 1, head_dim, seed), slots, heads, head_dim, device, dtype)
        self.sketch = torch.from_numpy(qjl_sketch(head_dim, bits, seed)).to(device, dtype)  # [D, D]
        self.sign_packing = TorchCodePacking(1, head_dim, device)  # bit j: sketch row j of the residual >= 0
        self.signs = torch.zeros((slots, heads, self.sign_packing.width), dtype=torch.uint8, device=device)
        self.res_norms = torch.zeros((slots, heads), dtype=torch.float16, device=device)
        self.head_dim = head_dim

    def write(self, x: torch.Tensor, slots: torch.Tensor) -> None:
        self.mse.write(x, slots)
        decoded = self.mse.unrotate(self.mse.rotated(slots[None])[0], 1)  # [T, Hkv, D]
        r = x.to(decoded.dtype) - decoded
        self.signs.index_copy_(0, slots, self.sign_packing.pack((r @ self.sketch.T >= 0).to(torch.uint8)))
        self.res_norms.index_copy_(0, slots, r.float().norm(dim=-1).to(torch.float16))

    def rotated(self, kv_slots: torch.Tensor) -> torch.Tensor:
        scale = self.res_norms[kv_slots].to(self.mse.dtype) * (math.sqrt(math.pi / 2) / self.head_dim)
        signs = self.sign_packing.unpack(self.signs[kv_slots]).to(self.mse.dtype) * 2 - 1  # [B, L, Hkv, D]: +-1
        sketch = signs * scale[..., None]
        return torch.cat([self.mse.rotated(kv_slots), sketch], dim=-1)

    @property
    def nbytes(self) -> int:
        return self.mse.nbytes + self.signs.nbytes + self.res_norms.nbytes

    def rotate_queries(self, q: torch.Tensor, group: int) -> torch.Tensor:
        return torch.cat([self.mse.rotate_queries(q, group), q @ self.sketch.T], dim=-1)


class TorchTQKV:
    """A layer's KV cache under a TurboQuant KVFormat (see the module docstring)."""

    def __init__(self, fmt: KVFormat, layer: int, slots: int, heads: int, head_dim: int,
                 device: torch.device, dtype: torch.dtype):
        fmt.check_head_dim(head_dim)
        seed = fmt.seed + 2 * layer
        self.keys: _CodedSets | _QJLKeys
        if fmt.qjl:
            self.keys = _QJLKeys(int(fmt.rate), slots, heads, head_dim, seed, device, dtype)
        else:
            self.keys = _CodedSets(mse_sets(fmt.rate, head_dim, seed), slots, heads, head_dim, device, dtype,
                                   fmt.centered)
        self.values = _CodedSets(mse_sets(fmt.rate, head_dim, seed + 1), slots, heads, head_dim, device, dtype,
                                 fmt.centered)

    @property
    def nbytes(self) -> int:
        """Bytes the layer's cache holds: packed codes, norms, QJL signs."""
        return self.keys.nbytes + self.values.nbytes

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: Any,
                  mask: torch.Tensor, scale: float) -> torch.Tensor:
        """Store k, v [T, Hkv, D]; attend q [T, H, D] over the coded cache -> [T, H, D]."""
        self.keys.write(k, ctx.slots)
        self.values.write(v, ctx.slots)
        group = q.shape[1] // k.shape[1]
        Q = self.keys.rotate_queries(q, group)[ctx.q_index].transpose(1, 2)  # [B, H, Tq, Dk']
        K = self.keys.rotated(ctx.kv_slots).transpose(1, 2)  # [B, Hkv, L, Dk']
        V = self.values.rotated(ctx.kv_slots).transpose(1, 2)  # [B, Hkv, L, Dv']
        out = F.scaled_dot_product_attention(Q.to(K.dtype), K, V, attn_mask=mask, scale=scale, enable_gqa=True)
        out = out.transpose(1, 2)[ctx.q_valid]  # [T, H, Dv']
        return self.values.unrotate(out, group).to(q.dtype)  # [T, H, D]
