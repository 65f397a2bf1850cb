"""Linear-attention layers on MLX: the torch backend's state pools (backends/cuda/recurrent.py) over
mx.array; a step gathers its sequences' slots, runs their tokens, scatters the states back, and keeps
the state after each token of a verification chunk for the next step to restore past rejected drafts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from twinfer.runtime.batch import StepBatch
from twinfer.runtime.kv.recurrent import DRAFT_ROLLBACK, StateBinding, StatePool, StateSlots
from twinfer.runtime.spec import LINEAR, ModelSpec


@dataclass
class MlxStateStep:
    """The step's state slots [B], which start from zeros [B, 1, 1] (float 0/1 keep factors), the valid
    query entries [B, Tq] and, per sequence, where in the padded conv input its new conv state starts."""

    slots: mx.array
    keep: mx.array
    valid: mx.array
    conv_tail: mx.array | None  # [B * (K-1)] rows of the flattened [B * (K-1+Tq), Ch] conv input
    kept: list[tuple[int, int, int]]  # chunks whose states after each token are kept: (row, seq_id, how many)


Kept = tuple[dict[int, mx.array], dict[int, mx.array]]  # per layer: conv [n, K-1, Ch], delta [n, Hv, Dk, Dv]


class MlxStates(StatePool):
    """The conv and delta states of every LINEAR layer, for all sequences a runner holds."""

    def __init__(self, spec: ModelSpec, dtype: mx.Dtype):
        assert spec.linear_attn is not None
        self.la, self.dtype = spec.linear_attn, dtype
        self.layers = [i for i, t in enumerate(spec.attention_types) if t == LINEAR]
        self.slots = StateSlots(DRAFT_ROLLBACK)
        self.kept: dict[int, Kept] = {}  # seq_id -> the states after each token of its last verification chunk
        self.conv: dict[int, mx.array] = {}
        self.delta: dict[int, mx.array] = {}
        self._capacity = 0
        self._grow(1)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (*self.conv.values(), *self.delta.values()))

    def arrays(self) -> list[mx.array]:
        """The pools and the states kept for a rollback: what a step writes."""
        kept = [a for conv, delta in self.kept.values() for a in (*conv.values(), *delta.values())]
        return [*self.conv.values(), *self.delta.values(), *kept]

    def bind(self, batch: StepBatch) -> MlxStateStep:
        binding = self.slots.bind(batch.chunks)
        if self.slots.capacity > self._capacity:
            self._grow(max(self.slots.capacity, 2 * self._capacity))
        lengths = np.asarray([len(c.tokens) for c in batch.chunks])
        B, Tq, K1 = len(lengths), int(lengths.max()), self.la.conv_kernel - 1
        valid = np.arange(Tq)[None, :] < lengths[:, None]
        tail = (np.arange(B)[:, None] * (K1 + Tq) + lengths[:, None] + np.arange(K1)[None, :]).reshape(-1)
        keep = 1.0 - np.asarray(binding.reset, dtype=np.float32)
        return MlxStateStep(mx.array(np.asarray(binding.slots, dtype=np.int32)), mx.array(keep),
                            mx.array(valid), mx.array(tail.astype(np.int32)) if K1 else None,
                            self._restore_and_keep(batch, binding))

    def _restore_and_keep(self, batch: StepBatch, binding: StateBinding) -> list[tuple[int, int, int]]:
        """Start chunks after rejected drafts from the kept state; make room for the states kept this step."""
        kept_rows = []
        for row, (c, slot, j, n) in enumerate(zip(batch.chunks, binding.slots, binding.restore, binding.keep,
                                                   strict=True)):
            kept = self.kept.pop(c.seq_id, None)
            if j >= 0:  # rejected drafts: start from the state after the last accepted token
                assert kept is not None
                for i, conv in kept[0].items():
                    self.conv[i][slot] = conv[j]
                for i, delta in kept[1].items():
                    self.delta[i][slot] = delta[j]
            if n:
                kept_rows.append((row, c.seq_id, n))
                self.kept[c.seq_id] = ({}, {})
        return kept_rows

    def _stored(self, layer: int) -> None:
        mx.eval(self.conv[layer], self.delta[layer])

    def _grow(self, capacity: int) -> None:
        """Room for `capacity` sequences; the states held keep their slots."""
        la, K = self.la, self.la.conv_kernel
        for i in self.layers:
            conv = mx.zeros((capacity, K - 1, la.conv_dim), dtype=self.dtype)
            delta = mx.zeros((capacity, la.num_v_heads, la.head_k_dim, la.head_v_dim), dtype=mx.float32)
            if i in self.conv:
                conv[: self._capacity] = self.conv[i]
                delta[: self._capacity] = self.delta[i]
            self.conv[i], self.delta[i] = conv, delta
        self._capacity = capacity
        mx.eval(self.arrays())

    def causal_conv1d(self, x: mx.array, w: mx.array, st: MlxStateStep, q_index: mx.array, q_flat: mx.array,
                      layer: int) -> mx.array:
        """See Ops.causal_conv1d. x [T, Ch], w [Ch, K]; q_index [B, Tq] and q_flat [T] place the tokens."""
        K = w.shape[1]
        B, Tq = q_index.shape
        pool = self.conv[layer]
        prev = mx.take(pool, st.slots, axis=0) * st.keep[:, None, None].astype(pool.dtype)  # [B, K-1, Ch]
        X = mx.where(st.valid[..., None], mx.take(x, q_index, axis=0), 0).astype(pool.dtype)  # [B, Tq, Ch]
        full = mx.concatenate([prev, X], axis=1)  # [B, K-1+Tq, Ch]
        out = full[:, :Tq] * w[:, 0]
        for j in range(1, K):
            out = out + full[:, j : j + Tq] * w[:, j]
        if st.conv_tail is not None:  # the new state: the K-1 inputs before each sequence's end
            tail = mx.take(full.reshape(B * (K - 1 + Tq), -1), st.conv_tail, axis=0)
            pool[st.slots] = tail.reshape(B, K - 1, -1)
            self.conv[layer] = pool
            for row, seq, n in st.kept:  # the state after each kept token: the K-1 inputs up to it
                after = mx.array((np.arange(1, n + 1)[:, None] + np.arange(K - 1)[None, :]).reshape(-1))
                self.kept[seq][0][layer] = mx.take(full[row], after, axis=0).reshape(n, K - 1, -1)
        return mx.take(out.reshape(B * Tq, -1), q_flat, axis=0).astype(x.dtype)  # [T, Ch]

    def gated_delta(self, q: mx.array, k: mx.array, v: mx.array, a: mx.array, b: mx.array, decay: mx.array,
                    dt_bias: mx.array, ctx: Any, layer: int) -> mx.array:
        """See Ops.gated_delta: q, k [T, Hk, Dk], v [T, Hv, Dv], a, b [T, Hv] -> [T, Hv, Dv]; `ctx` is the
        step's MlxStep (its state binding and token placement)."""
        st, q_index, q_flat = ctx.state, ctx.q_index, ctx.q_flat
        f32 = mx.float32
        Hv, Dv, Dk = v.shape[1], v.shape[2], q.shape[-1]
        B, Tq = q_index.shape
        rep = Hv // q.shape[1]
        g = decay.astype(f32) * _softplus(a.astype(f32) + dt_bias.astype(f32))  # [T, Hv]
        beta = mx.sigmoid(b.astype(f32))
        q = mx.repeat(_l2norm(q.astype(f32)), rep, axis=1) * Dk**-0.5  # [T, Hv, Dk]
        k = mx.repeat(_l2norm(k.astype(f32)), rep, axis=1)
        Q, Kk, V, G, Beta = (mx.take(t, q_index, axis=0) for t in (q, k, v.astype(f32), g, beta))
        pool = self.delta[layer]
        S = mx.take(pool, st.slots, axis=0) * st.keep[:, None, None, None]  # [B, Hv, Dk, Dv]
        out, trail, rows = [], [], mx.array([row for row, _, _ in st.kept], dtype=mx.int32)
        for t in range(Tq):
            new = S * mx.exp(G[:, t])[..., None, None]
            kv = (new * Kk[:, t, :, :, None]).sum(axis=-2)  # [B, Hv, Dv]
            delta = (V[:, t] - kv) * Beta[:, t, :, None]
            new = new + Kk[:, t, :, :, None] * delta[:, :, None, :]
            out.append((new * Q[:, t, :, :, None]).sum(axis=-2))
            S = mx.where(st.valid[:, t, None, None, None], new, S)  # padding keeps the state
            if st.kept:
                trail.append(mx.take(S, rows, axis=0))
        pool[st.slots] = S
        self.delta[layer] = pool
        for r, (_, seq, n) in enumerate(st.kept):
            self.kept[seq][1][layer] = mx.stack([S_t[r] for S_t in trail[:n]])  # [n, Hv, Dk, Dv]
        o = mx.stack(out, axis=1).reshape(B * Tq, Hv, Dv)
        return mx.take(o, q_flat, axis=0).astype(v.dtype)  # [T, Hv, Dv]


def _l2norm(x: mx.array, eps: float = 1e-6) -> mx.array:
    return x * mx.rsqrt((x * x).sum(axis=-1, keepdims=True) + eps)


def _softplus(x: mx.array) -> mx.array:
    # torch's F.softplus (beta 1, threshold 20): x itself above the threshold
    return mx.where(x > 20.0, x, mx.logaddexp(x, mx.zeros_like(x)))
