"""Expert-parallel MoE by all-to-all: send each token to the ranks holding its experts, and back.

The stage's n = ep * tp ranks each take a contiguous slice of the step's tokens (attention left
them replicated). A rank sends each of its (token, slot) pairs to the tp ranks of the expert group
that holds the pair's expert (`all_to_all_single` semantics: `Comm.all_to_all`), those ranks run
their experts over what they received (each computes its slice of the expert width), the outputs
come back the same way, and the owner sums them with the router weights. An all-gather of the token
slices leaves every rank with the whole step again, as the all-reduce combine does.
"""

from __future__ import annotations

from typing import Any

import torch

from twinfer.backends.cuda.ops import ExpertStack
from twinfer.backends.cuda.parallel.comm import Comm


def all_to_all_moe(ops: Any, stage: Comm, tp: int, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                   stack: ExpertStack, act: str) -> torch.Tensor:
    """The routed-expert sum over x [T, C] (same on every rank of `stage`); `ops.experts` runs the local ones.

    `experts`/`weights` [T, k] are the replicated routing; this rank holds `stack`, experts first .. first +
    len(gate).
    """
    T, C = x.shape
    n, me, k, dev = stage.size, stage.rank, experts.shape[1], x.device
    bounds = [T * i // n for i in range(n + 1)]
    lo, hi = bounds[me], bounds[me + 1]
    ids = experts[lo:hi].flatten()  # [Pm] this rank's pairs
    group = ids // stack.gate.shape[0]  # expert group holding each pair's expert
    dest = (group[:, None] * tp + torch.arange(tp, device=dev)[None, :]).flatten()  # [Pm * tp] stage ranks
    order = dest.argsort(stable=True)
    pair = torch.arange(ids.numel(), device=dev).repeat_interleave(tp)[order]  # [S] pair of each sent row
    counts = torch.bincount(dest, minlength=n)  # [n] rows for each rank
    got = stage.all_to_all(torch.empty_like(counts), counts, [1] * n, [1] * n)
    send, recv = counts.tolist(), got.tolist()  # the split sizes: this path's one wait for the device
    rows = stage.all_to_all(x.new_empty((sum(recv), C)), x[lo:hi][pair // k], recv, send)  # [R, C]
    their_ids = stage.all_to_all(ids.new_empty(sum(recv)), ids[pair], recv, send)  # [R]
    ones = x.new_ones((rows.shape[0], 1))  # the router weights are applied by the token's owner
    y = ops.experts(rows, ones, their_ids[:, None], stack, act)  # [R, C] partial over tp
    back = stage.all_to_all(x.new_empty((pair.numel(), C)), y, send, recv)  # [S, C]
    mine = torch.zeros((hi - lo, C), dtype=x.dtype, device=dev)
    mine.index_add_(0, pair // k, back * weights[lo:hi].flatten()[pair][:, None])
    width = -(-T // n)  # all-gather needs equal parts: pad each slice to the largest
    padded = torch.zeros((width, C), dtype=x.dtype, device=dev)
    padded[: hi - lo] = mine
    parts = stage.all_gather(padded, dim=0)  # [n * width, C]
    return torch.cat([parts[i * width : i * width + bounds[i + 1] - bounds[i]] for i in range(n)])
