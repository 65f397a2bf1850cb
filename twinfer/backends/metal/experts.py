"""Expert streaming over MLX: the array math of `runtime.experts.StreamingOps` and the runner builder.

Routing is `MlxOps`'s (float32 softmax, top-k, renormalized). Each expert's contribution is
evaluated as soon as it is added, so an evicted expert's buffer is freed before the next one is read
(a lazy graph would otherwise hold every expert a step touched until the step's final eval).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import mlx.core as mx
import numpy as np

from twinfer.backends.metal.ops import MlxOps, mlx_dtype
from twinfer.backends.metal.runner import _wire_working_set
from twinfer.runtime.experts import (
    ExpertArrays,
    ExpertCache,
    ExpertReader,
    Routed,
    StreamingOps,
    expert_params,
    streaming_weights,
)
from twinfer.runtime.kv.recurrent import DRAFT_ROLLBACK
from twinfer.runtime.ops import ExpertExtras, Ops
from twinfer.runtime.runner import KVLayout, OpsRunner
from twinfer.runtime.spec import MoESpec

if TYPE_CHECKING:
    from twinfer.runtime.loaders import LoadedModel


class MlxStreamingOps(StreamingOps):
    inner: MlxOps

    def _route(self, x: mx.array, router: mx.array, moe: MoESpec, extras: ExpertExtras | None
               ) -> tuple[mx.array, np.ndarray]:
        weights, experts = self.inner._route(x, router, moe, extras)  # noqa: SLF001 - the resident path's routing
        mx.eval(weights, experts)  # streaming's one wait per MoE layer: the host needs the expert ids
        return weights, np.array(experts)

    def _predict(self, x: mx.array, router: mx.array, k: int) -> list[int]:
        scores = mx.softmax((x @ router.T).astype(mx.float32), axis=-1).mean(axis=0)  # [E]
        order = np.argsort(-np.array(scores), kind="stable")
        return [int(e) for e in order[:k]]

    def _expert_out(self, out: mx.array | None, x: mx.array, routed: Routed, arrays: ExpertArrays,
                    moe: MoESpec, act: str, extras: ExpertExtras | None) -> mx.array:
        if out is None:
            out = mx.zeros_like(x)
        expert, tok, slot, weights = routed.expert, routed.tok, routed.slot, routed.weights
        gate, up, down = arrays
        xb = extras or ExpertExtras()

        def bias(y: mx.array, b: mx.array | None) -> mx.array:
            return y if b is None else y + b[expert]

        rows = mx.array(tok.astype(np.int32))
        w = weights[rows, mx.array(slot.astype(np.int32))]  # [n]
        h = mx.take(x, rows, axis=0)
        g, u = bias(h @ gate.T, xb.gate_bias), bias(h @ up.T, xb.up_bias)
        if moe.swiglu_limit is not None:  # gpt-oss, as MlxOps.moe runs it
            lim = moe.swiglu_limit
            g, u = mx.minimum(g, lim), mx.clip(u, -lim, lim)
            a = g * mx.sigmoid(g * moe.swiglu_alpha) * (u + 1)
        else:
            a = self.inner.act(g, act) * u
        out = out.at[rows].add(bias(a @ down.T, xb.down_bias) * w[:, None])
        mx.eval(out)
        return out


def load_streaming_mlx_runner(
    loaded: LoadedModel,
    *,
    cache_bytes: int,
    kv_tokens: int = 4096,
    block_size: int = 16,
    dtype: str | mx.Dtype = "float32",
    prefetch: bool = True,
) -> OpsRunner:
    """An MLX runner whose routed experts stay in the file behind an LRU cache of `cache_bytes`."""
    spec, w = loaded.spec, loaded.weights
    assert spec.moe is not None
    _wire_working_set()
    kv = KVLayout(block_size=block_size, num_blocks=-(-kv_tokens // block_size), recurrent=spec.recurrent,
                  state_rollback=DRAFT_ROLLBACK if spec.recurrent else 0)  # as the resident runner's
    ops = MlxOps(spec, num_blocks=kv.num_blocks, block_size=block_size, dtype=dtype)
    weights, routers = streaming_weights(w, spec, lambda name, a: _device(ops, name, a))
    cache = ExpertCache(
        ExpertReader(w), lambda a: _device(ops, "expert", a), cache_bytes,
        expert_params(spec) * mlx_dtype(dtype).size, spec.moe.top_k, prefetch_enabled=prefetch,
        on_evict=mx.clear_cache,  # hand freed expert buffers back instead of keeping them in MLX's pool
    )
    sops = MlxStreamingOps(ops, cache, routers, spec)
    return OpsRunner(spec, cast(Ops, sops), weights, kv, backend="mlx")


def _device(ops: MlxOps, name: str, host: np.ndarray) -> mx.array:
    arr = ops.weight(name, host)
    mx.eval(arr)  # materialize now, so the host copy can go
    return arr
