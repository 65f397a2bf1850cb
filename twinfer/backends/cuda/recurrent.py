"""Linear-attention layers on torch: the conv and delta-rule states per sequence, and the two ops over them.

Each LINEAR layer holds a pool of states, one slot per sequence (`runtime.kv.recurrent.StateSlots`
assigns them): conv [slots, K-1, Ch] in the model's dtype and delta [slots, Hv, Dk, Dv] in float32.
A step gathers its sequences' slots, runs their tokens in order (padded to [B, Tq] like attention's
queries; padding never updates a state) and scatters the new states back; of a verification chunk it
also keeps the state after each token, which the next step restores when drafts were rejected. The
delta rule runs the recurrent form token by token, which is exact for prefill too; a chunked form would
be faster there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from twinfer.runtime.batch import StepBatch
from twinfer.runtime.kv.recurrent import DRAFT_ROLLBACK, StatePool, StateSlots
from twinfer.runtime.spec import LINEAR, ModelSpec

if TYPE_CHECKING:
    from twinfer.backends.cuda.ops import TorchStep


@dataclass
class StateStep:
    """The step's state slots [B], which of them start from zeros [B] (bool), and the chunks whose
    states after each token are kept: (row, seq_id, how many)."""

    slots: torch.Tensor
    reset: torch.Tensor
    keep: list[tuple[int, int, int]] = field(default_factory=list)


Kept = tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]  # per layer: conv [n, K-1, Ch], delta [n, Hv, Dk, Dv]


class TorchStates(StatePool):
    """The conv and delta states of every LINEAR layer, for all sequences a runner holds."""

    def __init__(self, spec: ModelSpec, device: torch.device, dtype: torch.dtype):
        assert spec.linear_attn is not None
        self.spec, self.la, self.device, self.dtype = spec, spec.linear_attn, device, dtype
        self.layers = [i for i, t in enumerate(spec.attention_types) if t == LINEAR]
        self.slots = StateSlots(DRAFT_ROLLBACK)
        self.kept: dict[int, Kept] = {}  # seq_id -> the states after each token of its last verification chunk
        self.conv: dict[int, torch.Tensor] = {}
        self.delta: dict[int, torch.Tensor] = {}
        self._capacity = 0
        self._grow(1)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self.conv.values(), *self.delta.values()))

    def bind(self, batch: StepBatch) -> StateStep:
        binding = self.slots.bind(batch.chunks)
        if self.slots.capacity > self._capacity:
            self._grow(max(self.slots.capacity, 2 * self._capacity))
        keep = []
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
                keep.append((row, c.seq_id, n))
                self.kept[c.seq_id] = ({}, {})
        return StateStep(torch.tensor(binding.slots, device=self.device),
                         torch.tensor(binding.reset, device=self.device), keep)

    def _grow(self, capacity: int) -> None:
        """Room for `capacity` sequences; the states held keep their slots."""
        la, K = self.la, self.la.conv_kernel
        for i in self.layers:
            conv = torch.zeros((capacity, K - 1, la.conv_dim), dtype=self.dtype, device=self.device)
            delta = torch.zeros((capacity, la.num_v_heads, la.head_k_dim, la.head_v_dim), dtype=torch.float32,
                                device=self.device)
            if i in self.conv:
                conv[: self._capacity] = self.conv[i]
                delta[: self._capacity] = self.delta[i]
            self.conv[i], self.delta[i] = conv, delta
        self._capacity = capacity

    # -- the ops ---------------------------------------------------------------------------------
    def causal_conv1d(self, x: torch.Tensor, w: torch.Tensor, ctx: TorchStep, layer: int) -> torch.Tensor:
        """See Ops.causal_conv1d. x [T, Ch], w [Ch, K]; the step's q_index/q_valid [B, Tq] place the tokens."""
        st, q_index, q_valid = ctx.state, ctx.q_index, ctx.q_valid
        K, Tq = w.shape[1], q_index.shape[1]
        pool = self.conv[layer]
        prev = pool[st.slots].masked_fill(st.reset[:, None, None], 0.0)  # [B, K-1, Ch]
        X = x[q_index].masked_fill(~q_valid[..., None], 0.0)  # [B, Tq, Ch]
        full = torch.cat((prev, X.to(prev.dtype)), dim=1)  # [B, K-1+Tq, Ch]
        out = full[:, :Tq] * w[:, 0]  # [B, Tq, Ch]
        for j in range(1, K):
            out = out + full[:, j : j + Tq] * w[:, j]
        if K > 1:  # the new state: the K-1 inputs before each sequence's end
            ends = q_valid.sum(1)  # [B]
            take = ends[:, None] + torch.arange(K - 1, device=x.device)[None, :]  # [B, K-1]
            pool[st.slots] = full.gather(1, take[..., None].expand(-1, -1, full.shape[-1]))
            for row, seq, n in st.keep:  # the state after each kept token: the K-1 inputs up to it
                after = torch.arange(1, n + 1, device=x.device)[:, None] + torch.arange(K - 1, device=x.device)
                self.kept[seq][0][layer] = full[row, after]  # [n, K-1, Ch]
        return out[q_valid].to(x.dtype)

    def gated_delta(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                    decay: torch.Tensor, dt_bias: torch.Tensor, ctx: TorchStep, layer: int) -> torch.Tensor:
        """See Ops.gated_delta: q, k [T, Hk, Dk], v [T, Hv, Dv], a, b [T, Hv] -> [T, Hv, Dv]."""
        st, q_index, q_valid = ctx.state, ctx.q_index, ctx.q_valid
        Hv, Dk = v.shape[1], q.shape[-1]
        rep = Hv // q.shape[1]
        g = decay.float() * F.softplus(a.float() + dt_bias.float())  # [T, Hv]
        beta = torch.sigmoid(b.float())
        q = _l2norm(q.float()).repeat_interleave(rep, dim=1) * Dk**-0.5  # [T, Hv, Dk]
        k = _l2norm(k.float()).repeat_interleave(rep, dim=1)
        Q, Kk, V, G, Beta = (t[q_index] for t in (q, k, v.float(), g, beta))  # [B, Tq, ...]
        pool = self.delta[layer]
        S = pool[st.slots].masked_fill(st.reset[:, None, None, None], 0.0)  # [B, Hv, Dk, Dv]
        out, trail, rows = [], [], [row for row, _, _ in st.keep]
        for t in range(q_index.shape[1]):
            new = S * G[:, t].exp()[..., None, None]
            kv = torch.einsum("bhkv,bhk->bhv", new, Kk[:, t])  # [B, Hv, Dv]
            delta = (V[:, t] - kv) * Beta[:, t, :, None]
            new = new + Kk[:, t, :, :, None] * delta[:, :, None, :]
            out.append(torch.einsum("bhkv,bhk->bhv", new, Q[:, t]))
            S = torch.where(q_valid[:, t, None, None, None], new, S)  # padding keeps the state
            if rows:
                trail.append(S[rows])
        pool[st.slots] = S
        for r, (_, seq, n) in enumerate(st.keep):
            self.kept[seq][1][layer] = torch.stack([S_t[r] for S_t in trail[:n]])  # [n, Hv, Dk, Dv]
        return torch.stack(out, dim=1)[q_valid].to(v.dtype)  # [T, Hv, Dv]


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)
