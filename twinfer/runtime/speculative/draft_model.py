"""Draft-model proposers: a cheaper model drafts k tokens one at a time, batched across requests.
`DraftModelProposer` runs a second Runner with its own KV, rolled back by starting the next chunk
earlier; `SelfDraftProposer` runs the target with layers skipped over the target's paged KV, which the
verification pass overwrites."""

from __future__ import annotations

from typing import Any

import numpy as np

from twinfer.runtime.batch import LogitsWanted, SeqChunk, StepBatch
from twinfer.runtime.engine.sampler import draw, filtered, is_greedy
from twinfer.runtime.errors import TwinferError
from twinfer.runtime.kv.block_manager import BlockManager, OutOfBlocks
from twinfer.runtime.models.base import Model, Weights
from twinfer.runtime.ops import Array, Ops, StepContext
from twinfer.runtime.runner import OpsRunner, Runner
from twinfer.runtime.speculative.proposer import Dist, Draft, DraftQuery, Proposer, common_prefix


class DraftModelProposer(Proposer):
    """Proposes with a draft Runner sharing the target's tokenizer (`draft:PATH`)."""

    name = "draft"

    def __init__(self, runner: Runner, vocab_size: int | None = None):
        if runner.kv.recurrent:
            raise TwinferError(  # its catch-up chunks restart further back than a recurrent state is kept
                f"the draft model {runner.spec.name or runner.spec.model_type} keeps a recurrent state per "
                "sequence, which cannot be rolled back to where its drafts diverged: use a draft model "
                "without linear-attention layers, or --speculate ngram")
        self.runner = runner
        self.vocab_size = vocab_size or runner.spec.vocab_size  # the target's: drafts stay inside it
        kv = runner.kv
        self.blocks = BlockManager(kv.num_blocks, kv.block_size, enable_prefix_cache=False)
        self.held: dict[int, list[int]] = {}  # tokens whose KV the draft runner holds, per sequence

    def propose(self, queries: list[DraftQuery]) -> list[Draft | None]:
        starts = {q.seq_id: self._reserve(q) for q in queries}
        live = [q for q in queries if starts[q.seq_id] is not None]
        tokens: dict[int, list[int]] = {q.seq_id: [] for q in live}
        dists: dict[int, list[Dist | None]] = {q.seq_id: [] for q in live}
        chunks = []
        for q in live:
            start = starts[q.seq_id]
            assert start is not None
            chunks.append(self._chunk(q, q.tokens[start:], start))  # catch up, ending with the last token
        while live:
            logits = self.runner.step(StepBatch(chunks))
            for q, row in zip(live, logits, strict=True):
                token, dist = _pick(row[: self.vocab_size], q)
                tokens[q.seq_id].append(token)
                dists[q.seq_id].append(dist)
            for q in live:
                self._fed(q, tokens[q.seq_id])
            live = [q for q in live if len(tokens[q.seq_id]) < q.k]
            chunks = [self._chunk(q, tokens[q.seq_id][-1:], len(q.tokens) + len(tokens[q.seq_id]) - 1) for q in live]
        return [_draft(tokens[q.seq_id], dists[q.seq_id]) if q.seq_id in tokens else None for q in queries]

    def release(self, seq_id: int) -> None:
        if self.held.pop(seq_id, None) is not None:
            self.blocks.free(seq_id)
            self.runner.release(seq_id)

    def close(self) -> None:
        for seq_id in list(self.held):
            self.release(seq_id)
        close: Any = getattr(self.runner, "close", None)
        if close is not None:
            close()

    def _reserve(self, q: DraftQuery) -> int | None:
        """Blocks for the draft's positions [0, len(tokens) + k - 1); the first position to feed."""
        held = self.held.get(q.seq_id)
        if held is None and len(self.held) >= self.runner.kv.max_seqs:
            return None
        end = len(q.tokens) + q.k - 1
        if end > min(self.runner.spec.max_position, self.runner.kv.max_seq_tokens):
            return None
        try:
            self.blocks.allocate(q.seq_id, [], end, q.tokens)
        except OutOfBlocks:
            return None
        self.held.setdefault(q.seq_id, [])
        return min(common_prefix(held or [], q.tokens), len(q.tokens) - 1)

    def _chunk(self, q: DraftQuery, tokens: list[int], start: int) -> SeqChunk:
        return SeqChunk(q.seq_id, tokens, start, self.blocks.table(q.seq_id), LogitsWanted.LAST)

    def _fed(self, q: DraftQuery, drafted: list[int]) -> None:
        """Record the tokens now in the draft's cache: the query's tokens and all but the last draft."""
        self.held[q.seq_id] = q.tokens + drafted[:-1]


class SelfDraftProposer(DraftModelProposer):
    """The target model with layers skipped, over the target's own KV cache (`self:N`)."""

    name = "self"

    def __init__(self, target: Runner, skip: int):
        if not isinstance(target, OpsRunner):
            raise TwinferError(
                f"self-speculation (self:{skip}) needs a runner that runs layers itself (torch or mlx); "
                f"the {target.backend} runner computes the whole model at once: use --speculate "
                "draft:PATH with a smaller model (or the same file), or --speculate ngram"
            )
        if target.kv.recurrent:
            raise TwinferError(
                f"self-speculation (self:{skip}) would advance {target.spec.name or target.spec.model_type}'s "
                "recurrent state (linear-attention layers) with its drafts: use --speculate ngram or draft:PATH")
        layers = target.spec.num_layers
        draft = OpsRunner(target.spec, target.ops, target.weights, target.kv, target.backend)
        draft.model = LayerSubset(draft.model, kept_layers(layers, skip))
        super().__init__(draft)

    def release(self, seq_id: int) -> None:
        pass  # the KV is the target's

    def close(self) -> None:
        pass

    def _reserve(self, q: DraftQuery) -> int | None:
        # The scheduler gave the target blocks for the verification chunk, which covers the draft.
        return len(q.tokens) - 1

    def _chunk(self, q: DraftQuery, tokens: list[int], start: int) -> SeqChunk:
        return SeqChunk(q.seq_id, tokens, start, q.block_table, LogitsWanted.LAST)

    def _fed(self, q: DraftQuery, drafted: list[int]) -> None:
        pass


def kept_layers(num_layers: int, skip: int) -> list[int]:
    """The layers a self-draft runs: the skipped ones are spread evenly over the middle layers (the
    first layer and, when there is a choice, the last one always run, as in Draft & Verify)."""
    middle = list(range(1, num_layers - 1)) or list(range(1, num_layers))
    if not 0 < skip <= len(middle):
        raise TwinferError(f"self:{skip}: a {num_layers}-layer model can skip 1 to {len(middle)} layers")
    stride = len(middle) / skip
    dropped = {middle[int(i * stride + stride / 2)] for i in range(skip)}
    return [layer for layer in range(num_layers) if layer not in dropped]


class LayerSubset(Model):
    """A model file's forward pass over a subset of its layers (OpsRunner calls forward and logits)."""

    def __init__(self, model: Model, layers: list[int]):
        if type(model).forward is not Model.forward:
            raise TwinferError(f"self-speculation cannot skip layers of {type(model).__name__}: it has its own forward")
        super().__init__(model.spec)
        self.model = model
        self.layers = layers

    def forward(self, ops: Ops, w: Weights, ctx: StepContext) -> Array:
        m = self.model
        x = m.embed(ops, w, ctx)
        for layer in self.layers:
            x = m.block(ops, w, f"layers.{layer}.", layer, x, ctx)
        return ops.rms_norm(x, w["norm"], m.spec.rms_norm_eps)

    def logits(self, ops: Ops, w: Weights, h: Array) -> Array:
        return self.model.logits(ops, w, h)


def _pick(logits: np.ndarray, q: DraftQuery) -> tuple[int, Dist | None]:
    """The draft's token: its argmax for greedy requests, else a draw with the request's filters."""
    if is_greedy(q.row):
        return int(np.argmax(logits)), None
    dist = filtered(logits, q.row)
    return draw(*dist, q.row.rng), dist


def _draft(tokens: list[int], dists: list[Dist | None]) -> Draft:
    """Greedy requests get point masses; sampled ones carry the distribution of every token."""
    sampled = [d for d in dists if d is not None]
    return Draft(tokens, sampled if len(sampled) == len(tokens) else None)
