"""Quantized weights and the TurboQuant KV cache over MLX (the torch backend's scheme, MLX ops): affine
to `mx.quantized_matmul` unchanged, TurboQuant rotated, fp8/nvfp4/mxfp4 dequantized at load; the KV cache
as backends/cuda/quant.py's, built anew on each write."""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import numpy as np

from twinfer.formats.bitpack import code_group, packed_width
from twinfer.quant.kv_format import ChannelSet, KVFormat, mse_sets, qjl_sketch
from twinfer.quant.linear import QuantizedExperts, QuantizedWeight, tq_linear_parts


class MlxAffineLinear:
    """Affine int weight run by `mx.quantized_matmul` (MLX's own layout)."""

    def __init__(self, qw: QuantizedWeight, dtype: mx.Dtype):
        p = qw.packed
        self.bits, self.group = int(p.bits), int(p.group_size)
        self.wq = mx.array(p.wq)
        self.scales = mx.array(p.scales).astype(dtype)
        self.biases = mx.array(p.biases).astype(dtype)

    def __call__(self, x: mx.array, bias: mx.array | None) -> mx.array:
        y = mx.quantized_matmul(x, self.wq, self.scales, self.biases, transpose=True,
                                group_size=self.group, bits=self.bits)
        return y if bias is None else y + bias


class MlxTQLinear:
    """TurboQuant weight: rotate activation blocks, multiply by the codebook-decoded rotated weight."""

    def __init__(self, qw: QuantizedWeight, dtype: mx.Dtype):
        parts = tq_linear_parts(qw.packed)
        self.shape, self.block = parts.shape, parts.block
        self.channels = [mx.array(c.astype(np.int32)) for c in parts.channels]  # [G, d_s]
        self.rotation = [mx.array(r).astype(dtype) for r in parts.rotation]  # [D_s, d_s]
        self.codes = [mx.array(c) for c in parts.codes]  # uint8 [out, G, D_s]
        self.scales = [mx.array(s).astype(dtype) for s in parts.scales]  # [out, G]
        self.centroids = [mx.array(c).astype(dtype) for c in parts.centroids]

    def __call__(self, x: mx.array, bias: mx.array | None) -> mx.array:
        out, inp = self.shape
        lead = x.shape[:-1]
        G = inp // self.block
        xb = x.reshape(-1, G, self.block)  # [M, G, block]
        y: mx.array | None = None
        for idx, rot, codes, scale, cent in zip(
            self.channels, self.rotation, self.codes, self.scales, self.centroids, strict=True
        ):
            xs = mx.take_along_axis(xb, mx.broadcast_to(idx[None], (xb.shape[0], *idx.shape)), axis=2)
            xr = xs @ rot.T  # [M, G, D_s]
            wr = mx.take(cent, codes.astype(mx.int32)) * scale[..., None]  # [out, G, D_s]
            part = xr.reshape(xr.shape[0], -1) @ wr.reshape(out, -1).T
            y = part if y is None else y + part
        assert y is not None
        if bias is not None:
            y = y + bias
        return y.reshape(*lead, out)


def mlx_weight(qw: QuantizedWeight | QuantizedExperts, dtype: mx.Dtype) -> Any:
    """The MLX form of a quantized weight: a callable linear, or a dense array (stacked experts too)."""
    if isinstance(qw, QuantizedExperts):
        return mx.array(qw.dequantize()).astype(dtype)
    if qw.fmt in ("int8", "int4"):
        return MlxAffineLinear(qw, dtype)
    if qw.fmt.startswith("tq"):
        return MlxTQLinear(qw, dtype)
    return mx.array(qw.dequantize()).astype(dtype)


class MlxCodePacking:
    """Rows of `n` codes of `bits` bits <-> uint8 `[..., packed_width(n, bits)]`: TorchCodePacking in MLX."""

    def __init__(self, bits: int, n: int):
        self.bits, self.n = bits, n
        self.group, self.word_bytes = code_group(bits)
        self.width = packed_width(n, bits)
        self.word = mx.int32 if self.word_bytes <= 3 else mx.int64
        self.code_shifts = mx.arange(self.group, dtype=self.word) * bits  # [G]
        self.byte_shifts = mx.arange(self.word_bytes, dtype=self.word) * 8  # [W]

    def pack(self, codes: mx.array) -> mx.array:
        """uint8 codes [..., n] (each < 2**bits) -> uint8 [..., width]."""
        lead = codes.shape[:-1]
        pad = [(0, 0)] * len(lead) + [(0, -self.n % self.group)]
        runs = mx.pad(codes, pad).reshape(*lead, -1, self.group).astype(self.word)  # [..., n/G, G]
        words = mx.sum(runs << self.code_shifts, axis=-1)  # disjoint bit ranges: the sum is an OR
        return ((words[..., None] >> self.byte_shifts) & 0xFF).astype(mx.uint8).reshape(*lead, self.width)

    def unpack(self, packed: mx.array) -> mx.array:
        """uint8 [..., width] -> uint8 codes [..., n]."""
        lead = packed.shape[:-1]
        runs = packed.reshape(*lead, -1, self.word_bytes).astype(self.word)  # [..., n/G, W]
        words = mx.sum(runs << self.byte_shifts, axis=-1)
        codes = (words[..., None] >> self.code_shifts) & ((1 << self.bits) - 1)  # [..., n/G, G]
        return codes.reshape(*lead, -1)[..., : self.n].astype(mx.uint8)


class _CodedSets:
    """Keys or values of one layer under TurboQuant-MSE channel sets (packed codes, float16 norms)."""

    def __init__(self, sets: tuple[ChannelSet, ...], slots: int, heads: int, head_dim: int, dtype: mx.Dtype,
                 centered: bool = False):
        self.sets, self.heads, self.head_dim, self.dtype = sets, heads, head_dim, dtype
        self.centered = centered
        self.mean: mx.array | None = None  # [Hkv, D], fixed at the first write when centered
        self.rot = [mx.array(s.rotation).astype(dtype) for s in sets]
        self.cent = [mx.array(s.centroids).astype(dtype) for s in sets]
        self.bounds = [mx.array(s.boundaries).astype(dtype) for s in sets]
        self.packing = [MlxCodePacking(s.bits, s.padded_dim) for s in sets]
        self.codes = [mx.zeros((slots, heads, p.width), dtype=mx.uint8) for p in self.packing]
        self.norms = [mx.zeros((slots, heads), dtype=mx.float16) for _ in sets]
        self.channels: list[mx.array] | None = None
        if len(sets) == 1:
            self.channels = [mx.broadcast_to(mx.arange(head_dim, dtype=mx.int32), (heads, head_dim))]

    def arrays(self) -> list[mx.array]:
        return [*self.codes, *self.norms, *([self.mean] if self.mean is not None else [])]

    def _calibrate(self, x: mx.array) -> None:
        rms = mx.mean(x.astype(mx.float32) ** 2, axis=0)  # [Hkv, D]
        order = mx.argsort(-rms, axis=-1)
        n_hi = self.sets[0].dim
        self.channels = [mx.sort(order[:, :n_hi], axis=-1), mx.sort(order[:, n_hi:], axis=-1)]

    @staticmethod
    def _gather(x: mx.array, idx: mx.array) -> mx.array:
        """x [..., H, D] at channels idx [H, d] -> [..., H, d]."""
        return mx.take_along_axis(x, mx.broadcast_to(idx, (*x.shape[:-2], *idx.shape)), axis=-1)

    def write(self, x: mx.array, slots: mx.array) -> None:
        if self.centered:
            if self.mean is None:
                self.mean = mx.mean(x.astype(self.dtype), axis=0)
            x = x.astype(self.dtype) - self.mean
        if self.channels is None:
            self._calibrate(x)
        assert self.channels is not None
        for i, s in enumerate(self.sets):
            xs = self._gather(x.astype(self.dtype), self.channels[i])  # [T, Hkv, d_s]
            norm = mx.sqrt(mx.sum(xs.astype(mx.float32) ** 2, axis=-1))  # [T, Hkv]
            unit = xs / mx.where(norm > 0, norm, 1.0)[..., None].astype(xs.dtype)
            z = (unit @ self.rot[i].T) * math.sqrt(s.padded_dim)  # [T, Hkv, D_s]
            codes = mx.sum(z[..., None] > self.bounds[i], axis=-1).astype(mx.uint8)  # searchsorted left
            self.codes[i][slots] = self.packing[i].pack(codes)
            self.norms[i][slots] = norm.astype(mx.float16)

    def rotated(self, kv_slots: mx.array) -> mx.array:
        out = []
        for i, s in enumerate(self.sets):
            scale = mx.take(self.norms[i], kv_slots, axis=0).astype(self.dtype) / math.sqrt(s.padded_dim)
            codes = self.packing[i].unpack(mx.take(self.codes[i], kv_slots, axis=0)).astype(mx.int32)
            out.append(mx.take(self.cent[i], codes) * scale[..., None])
        return mx.concatenate(out, axis=-1)

    def rotate_queries(self, q: mx.array, group: int) -> mx.array:
        assert self.channels is not None
        return mx.concatenate(
            [self._gather(q, mx.repeat(c, group, axis=0)) @ r.T for c, r in zip(self.channels, self.rot, strict=True)],
            axis=-1,
        )

    def unrotate(self, y: mx.array, group: int) -> mx.array:
        assert self.channels is not None
        out = mx.zeros((*y.shape[:-1], self.head_dim), dtype=y.dtype)
        start = 0
        for i, s in enumerate(self.sets):
            piece = y[..., start : start + s.padded_dim] @ self.rot[i]  # [..., H, d_s]
            start += s.padded_dim
            idx = mx.repeat(self.channels[i], group, axis=0)
            out = mx.put_along_axis(out, mx.broadcast_to(idx, piece.shape), piece, axis=-1)
        if self.mean is not None:  # attention weights sum to 1, so the value mean comes back whole
            out = out + mx.repeat(self.mean, group, axis=0)
        return out


class _QJLKeys:
    """Keys under TurboQuant-prod: (bits - 1)-bit MSE codes plus the residual's 1-bit QJL sketch."""

    def __init__(self, bits: int, slots: int, heads: int, head_dim: int, seed: int, dtype: mx.Dtype):
        self.mse = _CodedSets(mse_sets(bits - 1, head_dim, seed), slots, heads, head_dim, dtype)
        self.sketch = mx.array(qjl_sketch(head_dim, bits, seed)).astype(dtype)
        self.sign_packing = MlxCodePacking(1, head_dim)  # bit j: sketch row j of the residual >= 0
        self.signs = mx.zeros((slots, heads, self.sign_packing.width), dtype=mx.uint8)
        self.res_norms = mx.zeros((slots, heads), dtype=mx.float16)
        self.head_dim = head_dim

    def arrays(self) -> list[mx.array]:
        return [*self.mse.arrays(), self.signs, self.res_norms]

    def write(self, x: mx.array, slots: mx.array) -> None:
        self.mse.write(x, slots)
        decoded = self.mse.unrotate(self.mse.rotated(slots[None])[0], 1)
        r = x.astype(decoded.dtype) - decoded
        self.signs[slots] = self.sign_packing.pack((r @ self.sketch.T >= 0).astype(mx.uint8))
        self.res_norms[slots] = mx.sqrt(mx.sum(r.astype(mx.float32) ** 2, axis=-1)).astype(mx.float16)

    def rotated(self, kv_slots: mx.array) -> mx.array:
        scale = mx.take(self.res_norms, kv_slots, axis=0).astype(self.mse.dtype)
        scale = scale * (math.sqrt(math.pi / 2) / self.head_dim)
        signs = self.sign_packing.unpack(mx.take(self.signs, kv_slots, axis=0)).astype(self.mse.dtype) * 2 - 1
        sketch = signs * scale[..., None]  # signs: [B, L, Hkv, D] of +-1
        return mx.concatenate([self.mse.rotated(kv_slots), sketch], axis=-1)

    def rotate_queries(self, q: mx.array, group: int) -> mx.array:
        return mx.concatenate([self.mse.rotate_queries(q, group), q @ self.sketch.T], axis=-1)


class MlxTQKV:
    """A layer's KV cache under a TurboQuant KVFormat."""

    def __init__(self, fmt: KVFormat, layer: int, slots: int, heads: int, head_dim: int, dtype: mx.Dtype):
        fmt.check_head_dim(head_dim)
        seed = fmt.seed + 2 * layer
        self.keys: _CodedSets | _QJLKeys
        if fmt.qjl:
            self.keys = _QJLKeys(int(fmt.rate), slots, heads, head_dim, seed, dtype)
        else:
            self.keys = _CodedSets(mse_sets(fmt.rate, head_dim, seed), slots, heads, head_dim, dtype, fmt.centered)
        self.values = _CodedSets(mse_sets(fmt.rate, head_dim, seed + 1), slots, heads, head_dim, dtype,
                                 fmt.centered)

    def arrays(self) -> list[mx.array]:
        """Every cache array (evaluated with the logits at the end of a step)."""
        return [*self.keys.arrays(), *self.values.arrays()]

    @property
    def nbytes(self) -> int:
        """Bytes the layer's cache holds: packed codes, norms, QJL signs."""
        return sum(a.nbytes for a in self.arrays())

    def attention(self, q: mx.array, k: mx.array, v: mx.array, ctx: Any, mask: mx.array,
                  scale: float) -> mx.array:
        """Store k, v [T, Hkv, D]; attend q [T, H, D] over the coded cache -> [T, H, D]."""
        self.keys.write(k, ctx.slots)
        self.values.write(v, ctx.slots)
        T, H, D = q.shape
        Hkv = k.shape[1]
        group = H // Hkv
        B, Tq = ctx.q_index.shape
        Q = mx.take(self.keys.rotate_queries(q, group), ctx.q_index, axis=0)  # [B, Tq, H, Dk']
        Q = Q.reshape(B, Tq, Hkv, group, -1).transpose(0, 2, 3, 1, 4)  # [B, Hkv, g, Tq, Dk']
        K = self.keys.rotated(ctx.kv_slots).transpose(0, 2, 1, 3)[:, :, None]  # [B, Hkv, 1, L, Dk']
        V = self.values.rotated(ctx.kv_slots).transpose(0, 2, 1, 3)[:, :, None]  # [B, Hkv, 1, L, Dv']
        s = (Q.astype(mx.float32) @ K.astype(mx.float32).swapaxes(-1, -2)) * scale  # [B, Hkv, g, Tq, L]
        s = mx.where(mask[:, :, None], s, -mx.inf)  # mask [B, 1, Tq, L]
        p = mx.softmax(s, axis=-1, precise=True).astype(V.dtype)
        out = (p @ V).transpose(0, 3, 1, 2, 4).reshape(B * Tq, H, -1)  # [B * Tq, H, Dv']
        out = mx.take(out, ctx.q_flat, axis=0)  # [T, H, Dv']
        return self.values.unrotate(out, group).astype(q.dtype)
