"""Expert streaming over torch: the array math of `runtime.experts.StreamingOps` and the runner builder.

Routing and the per-expert feed-forward are the same calls, in the same order, as `TorchOps.moe`, so a
streamed run computes the same numbers as a fully resident one.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, cast

import numpy as np
import torch
import torch.nn.functional as F

from twinfer.backends.cuda.ops import ExpertStack, TorchOps
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


class TorchStreamingOps(StreamingOps):
    inner: TorchOps

    def _route(self, x: torch.Tensor, router: torch.Tensor, moe: MoESpec, extras: ExpertExtras | None
               ) -> tuple[torch.Tensor, np.ndarray]:
        weights, experts = self.inner.route(x, router, moe, extras)  # the resident path's routing, exactly
        return weights, experts.cpu().numpy()

    def _predict(self, x: torch.Tensor, router: torch.Tensor, k: int) -> list[int]:
        scores = F.linear(x, router).float().softmax(-1).mean(0)  # [E] mean over the step's rows
        return [int(e) for e in scores.topk(k).indices.tolist()]

    def _expert_out(self, out: torch.Tensor | None, x: torch.Tensor, routed: Routed, arrays: ExpertArrays,
                    moe: MoESpec, act: str, extras: ExpertExtras | None) -> torch.Tensor:
        if out is None:
            out = torch.zeros_like(x)
        expert, weights = routed.expert, routed.weights
        rows = torch.as_tensor(routed.tok, device=x.device)
        cols = torch.as_tensor(routed.slot, device=x.device)
        gate, up, down = (a[None] for a in arrays)  # [1, ...]: the resident loop's expert 0
        y = self.inner._expert(x[rows], 0, ExpertStack(gate, up, down), act, moe, _one_expert(extras, expert))  # noqa: SLF001
        out.index_add_(0, rows, y * weights[rows, cols][:, None])
        return out


def _one_expert(extras: ExpertExtras | None, e: int) -> ExpertExtras | None:
    """`extras` with expert `e`'s biases alone, as the resident loop's expert 0."""
    if extras is None or extras.gate_bias is None:
        return extras
    def pick(b: torch.Tensor | None) -> torch.Tensor | None:
        return None if b is None else b[e : e + 1]
    return replace(extras, gate_bias=pick(extras.gate_bias), up_bias=pick(extras.up_bias),
                   down_bias=pick(extras.down_bias))


def load_streaming_torch_runner(
    loaded: LoadedModel,
    *,
    cache_bytes: int,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    kv_tokens: int = 4096,
    block_size: int = 16,
    prefetch: bool = True,
    threads: int | None = None,
) -> OpsRunner:
    """A torch runner whose routed experts stay in the file behind an LRU cache of `cache_bytes`
    (`threads` caps torch's CPU threads)."""
    if threads:
        torch.set_num_threads(threads)
    spec, w = loaded.spec, loaded.weights
    assert spec.moe is not None
    kv = KVLayout(block_size=block_size, num_blocks=-(-kv_tokens // block_size), recurrent=spec.recurrent,
                  state_rollback=DRAFT_ROLLBACK if spec.recurrent else 0)  # as the resident runner's
    ops = TorchOps(spec, num_blocks=kv.num_blocks, block_size=block_size, device=device, dtype=dtype)
    weights, routers = streaming_weights(w, spec, ops.weight)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    cache = ExpertCache(
        ExpertReader(w), lambda a: ops.weight("expert", a), cache_bytes,
        expert_params(spec) * itemsize, spec.moe.top_k, prefetch_enabled=prefetch,
    )
    sops = TorchStreamingOps(ops, cache, routers, spec)
    runner = OpsRunner(spec, cast(Ops, sops), weights, kv, backend="torch")
    return runner
