"""One rank's share of a model: sharded weights, the Ops that combine them, and a pipeline step.

The architecture file is unchanged: `ParallelTorchOps` recognises the sharded weights it is handed
(row-parallel, vocab-parallel, expert shards) and adds the collective each one needs, so
parallelism is a transform of the built model, never a flag inside `forward`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F

from twinfer.backends.cuda.ops import ExpertStack, TorchOps
from twinfer.backends.cuda.parallel.comm import Comm
from twinfer.backends.cuda.parallel.dispatch import all_to_all_moe
from twinfer.backends.cuda.parallel.layout import ParallelConfig, RankPosition
from twinfer.backends.cuda.parallel.shard import (
    EXPERTS,
    NORM,
    ROW,
    VOCAB,
    WeightReader,
    local_spec,
    read_part,
    shard_request,
)
from twinfer.runtime.batch import StepBatch
from twinfer.runtime.models import model_for
from twinfer.runtime.ops import ExpertExtras, Ops
from twinfer.runtime.spec import ModelSpec, MoESpec

LOGITS_TAG = 1 << 20  # pipeline tags: micro-batch index for hidden states, this + index for logits


@dataclass
class Sharded:
    """A weight slice that needs a collective after use: ROW (sum over tp), VOCAB (tp), EXPERTS (stage),
    NORM (the mean square over tp)."""

    tensor: torch.Tensor
    kind: str
    offset: int = 0  # VOCAB: first token id held; EXPERTS: first expert id held; NORM: values summed over


class ParallelTorchOps(TorchOps):
    """TorchOps whose linear, embedding and moe combine sharded weights across ranks."""

    def __init__(self, spec: ModelSpec, **kwargs: Any):
        super().__init__(spec, **kwargs)
        self.tp = self.stage = Comm(None, [0], 0)  # set by ShardedModel.connect
        self.config = ParallelConfig()  # set by ShardedModel: picks the MoE combine

    def linear(self, x: torch.Tensor, w: Any, bias: torch.Tensor | None = None) -> torch.Tensor:
        if not isinstance(w, Sharded):
            return super().linear(x, w, bias)
        if w.kind == ROW:  # partial sums of the input features held here
            y = self.tp.all_reduce(F.linear(x, w.tensor))
            return y if bias is None else y + bias
        assert w.kind == VOCAB  # lm_head (or the tied embedding): each rank has a slice of the vocabulary
        return self.tp.all_gather(F.linear(x, w.tensor, bias), dim=-1)

    def rms_norm(self, x: torch.Tensor, w: Any, eps: float) -> torch.Tensor:
        if not isinstance(w, Sharded):
            return super().rms_norm(x, w, eps)
        xf = x.float()  # this rank's heads of a norm over the whole projection: sum the squares of all ranks
        mean_square = self.tp.all_reduce(xf.pow(2).sum(-1, keepdim=True)) / w.offset
        return (xf * torch.rsqrt(mean_square + eps) * w.tensor.float()).to(x.dtype)

    def embedding(self, table: Any, ids: torch.Tensor) -> torch.Tensor:
        if not isinstance(table, Sharded):
            return F.embedding(ids, table)
        n = table.tensor.shape[0]
        local = ids - table.offset
        held = (local >= 0) & (local < n)
        rows = F.embedding(local.clamp(0, n - 1), table.tensor) * held[:, None].to(table.tensor.dtype)
        return self.tp.all_reduce(rows)  # exactly one rank contributes each row

    def moe(self, x: torch.Tensor, router: torch.Tensor, gate: Any, up: Any, down: Any, moe: MoESpec,
            act: str, extras: ExpertExtras | None = None) -> torch.Tensor:
        if not isinstance(gate, Sharded):
            return super().moe(x, router, gate, up, down, moe, act, extras)
        extras = self._local_extras(extras)
        weights, experts = self.route(x, router, moe, extras)  # the router is replicated: same routing everywhere
        plain = moe.swiglu_limit is None and (extras is None or extras.gate_bias is None)
        stack = ExpertStack(gate.tensor, up.tensor, down.tensor, first=gate.offset)
        if plain and self.config.ep_all_to_all(x.shape[0], moe.top_k):
            return all_to_all_moe(self, self.stage, self.tp.size, x, weights, experts, stack, act)
        out = self.experts(x, weights, experts, stack, act, moe=moe, extras=extras)
        return self.stage.all_reduce(out)  # combine: every expert group's and tensor rank's share

    def _local_extras(self, extras: ExpertExtras | None) -> ExpertExtras | None:
        """The expert biases this rank holds; the down bias only on tensor rank 0 (the combine sums the ranks)."""
        if extras is None:
            return None

        def local(b: Any) -> Any:
            return b.tensor if isinstance(b, Sharded) else b

        down = local(extras.down_bias) if self.tp.rank == 0 else None
        # the router's own weights (biases, Gemma 4's input and per-expert scale) stay replicated, by global id
        return replace(extras, gate_bias=local(extras.gate_bias), up_bias=local(extras.up_bias), down_bias=down)


class ShardedModel:
    """One rank's stage of the model. Every rank calls `step` with the same batch, in the same order."""

    def __init__(self, spec: ModelSpec, pos: RankPosition, weights: WeightReader, *, device: torch.device,
                 dtype: torch.dtype, num_blocks: int, block_size: int):
        pos.config.check(spec)
        self.spec, self.pos = spec, pos
        self.comms: dict[str, Comm] = {}
        self.local = local_spec(spec, pos)
        self.ops = ParallelTorchOps(self.local, num_blocks=num_blocks, block_size=block_size, device=device,
                                    dtype=dtype, layers=pos.layers)
        self.ops.config = pos.config
        self.model = model_for(self.local)
        self.weights: dict[str, Any] = {}
        for name in weights.names():
            part = shard_request(name, weights.shape(name), spec, pos)
            if part is None:  # another stage's weight: never read
                continue
            t = self.ops.weight(name, read_part(weights, name, part))
            self.weights[name] = Sharded(t, part.kind, part.offset) if part.kind in (ROW, VOCAB, EXPERTS, NORM) else t
        if "lm_head" in self.weights and "embed" not in self.weights:
            self.weights["embed"] = self.weights["lm_head"]  # `Model.logits` evaluates w["embed"] as its default

    def connect(self, comms: dict[str, Comm]) -> None:
        """Attach the process groups ("control", "world", "stage", "tp") once every rank has loaded."""
        self.comms = comms
        self.ops.tp, self.ops.stage = comms["tp"], comms["stage"]

    def release(self, seq_id: int) -> None:
        """Free the sequence's recurrent state slots on this rank (every rank binds slots alike)."""
        if self.spec.recurrent:
            self.ops.release_state(seq_id)

    def micro_batches(self, batch: StepBatch) -> list[StepBatch]:
        """Contiguous groups of chunks, one per pipeline slot, so stages overlap within a step."""
        c = self.pos.config
        if c.pp == 1:
            return [batch]
        m = min(len(batch.chunks), c.micro_batches or c.pp)
        bounds = np.linspace(0, len(batch.chunks), m + 1).round().astype(int)
        return [StepBatch(batch.chunks[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]

    def step(self, batch: StepBatch) -> np.ndarray | None:
        """Run this rank's stage over every micro-batch; rank 0 gets float32 logits, others None."""
        pos, world = self.pos, self.comms["world"]
        last = pos.rank_of(pos.config.pp - 1, 0, 0)  # the last stage's rank that reports logits
        pending: list[Any] = []  # (work, tensor) pairs kept alive until their sends finish
        out: list[torch.Tensor] = []
        parts = self.micro_batches(batch)
        with torch.inference_mode():
            for i, mb in enumerate(parts):
                x = self._stage_forward(mb, i)
                if not pos.last_stage:
                    x = x.contiguous()
                    pending.append((world.send(x, pos.peer_in(pos.stage + 1), tag=i), x))
                elif mb.num_logit_rows and pos.rank == 0:
                    out.append(x)
                elif mb.num_logit_rows and pos.rank == last:
                    x = x.float().contiguous()
                    pending.append((world.send(x, 0, tag=LOGITS_TAG + i), x))
            if pos.rank == 0 and not pos.last_stage:
                vocab = self.spec.vocab_size
                for i, mb in enumerate(parts):
                    if mb.num_logit_rows:
                        buf = torch.empty((mb.num_logit_rows, vocab), dtype=torch.float32, device=self.ops.device)
                        out.append(world.recv(buf, last, tag=LOGITS_TAG + i))
            for work, _ in pending:
                work.wait()
        if pos.rank != 0:
            return None
        if not out:
            return np.zeros((0, self.spec.vocab_size), dtype=np.float32)
        return np.concatenate([self.ops.to_host(t) for t in out])

    def _stage_forward(self, mb: StepBatch, index: int) -> torch.Tensor:
        """Hidden states [T, C] for the next stage, or the last stage's logits [R, V]."""
        ops, w, model, pos = self.ops, self.weights, self.model, self.pos
        mops = cast(Ops, ops)  # Ops types its step context as a protocol, TorchOps as its own class
        ctx = ops.begin_step(mb)
        if pos.first_stage:
            x = model.embed(mops, w, ctx)
        else:
            x = torch.empty((mb.num_tokens, self.spec.hidden_size), dtype=ops.dtype, device=ops.device)
            self.comms["world"].recv(x, pos.peer_in(pos.stage - 1), tag=index)
        for layer in pos.layers:
            x = model.block(mops, w, f"layers.{layer}.", layer, x, ctx)
        if not pos.last_stage:
            return x
        if not mb.num_logit_rows:  # a prefill chunk that only fills the KV cache
            return x[:0]
        rows = ops.select_rows(x, ctx)  # [R, C]: the norm is per row, so select first
        return model.logits(mops, w, ops.rms_norm(rows, w["norm"], self.spec.rms_norm_eps))
