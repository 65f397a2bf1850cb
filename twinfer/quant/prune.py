"""Pruning: remove the transformer blocks (and MoE experts) that change the model least.
Layers are ranked by `kl` (default: greedy, the removal with least KL(original || pruned) each round) or
`influence` (ShortGPT's block influence, one pass but local); experts per layer by the routing mass they
receive. The pruned model is written in the input's format (docs/quantization.md, "Pruning")."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from twinfer.runtime.batch import LogitsWanted, SeqChunk, StepBatch
from twinfer.runtime.errors import TwinferError
from twinfer.runtime.runner import OpsRunner, Runner
from twinfer.runtime.spec import ModelSpec

if TYPE_CHECKING:
    from twinfer.quant.fidelity import RunnerFactory


@dataclass
class Influence:
    """Per-layer block influence and, for MoE models, per-layer expert routing mass."""

    layers: np.ndarray  # [L] mean 1 - cos(block input, block output)
    experts: np.ndarray | None = None  # [L, E] routing mass per token (rows of dense layers are 0)
    tokens: int = 0

    def layer_order(self) -> list[int]:
        """Layers from least to most influential."""
        return [int(i) for i in np.argsort(self.layers, kind="stable")]

    def layers_to_remove(self, n: int) -> list[int]:
        """The `n` least influential layers, in layer order."""
        L = len(self.layers)
        if not 0 <= n < L:
            raise TwinferError(f"cannot remove {n} of {L} layers: keep at least one (0 <= --layers < {L})")
        return sorted(self.layer_order()[:n])

    def experts_to_keep(self, n_remove: int) -> dict[int, list[int]]:
        """Per MoE layer, the experts left after removing the `n_remove` with the least routing mass."""
        if self.experts is None:
            if n_remove:
                raise TwinferError("--experts prunes routed experts, and this model has none")
            return {}
        E = self.experts.shape[1]
        return {layer: sorted(int(e) for e in np.argsort(-row, kind="stable")[: E - n_remove])
                for layer, row in enumerate(self.experts) if row.any()}


class _RouterRecorder:
    """Wraps Ops: records each MoE layer's routing mass, then runs the backend's own `moe`."""

    def __init__(self, inner: Any, spec: ModelSpec, mass: np.ndarray):
        self.inner, self.spec, self.mass = inner, spec, mass
        self.moe_layers = [i for i in range(spec.num_layers) if spec.is_moe_layer(i)]
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def moe(self, x: Any, router: Any, gate: Any, up: Any, down: Any, moe: Any, act: str) -> Any:
        logits = self.inner.to_host(self.inner.linear(x, router)).astype(np.float64)  # [T, E]
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        top = np.argsort(-probs, axis=-1, kind="stable")[:, : moe.top_k]  # [T, k]
        weights = np.take_along_axis(probs, top, axis=-1)
        if moe.norm_topk_prob or not moe.router_softmax_before_topk:
            weights /= weights.sum(-1, keepdims=True)
        layer = self.moe_layers[self.calls % len(self.moe_layers)]
        np.add.at(self.mass[layer], top.ravel(), weights.ravel())
        self.calls += 1
        return self.inner.moe(x, router, gate, up, down, moe, act)


@dataclass
class _Acc:
    cos_gap: np.ndarray
    tokens: int = 0
    mass: np.ndarray = field(default_factory=lambda: np.zeros(0))


def measure_influence(runner: Runner, windows: list[list[int]]) -> Influence:
    """Block influence (and expert routing mass) of an Ops runner over teacher-forced `windows`."""
    if not isinstance(runner, OpsRunner):
        raise TwinferError("measuring block influence needs the torch or mlx backend (--backend torch)")
    spec = runner.spec
    E = spec.moe.num_experts if spec.moe else 0
    acc = _Acc(np.zeros(spec.num_layers), mass=np.zeros((spec.num_layers, E)))
    ops = _RouterRecorder(runner.ops, spec, acc.mass) if spec.moe else runner.ops
    for seq, tokens in enumerate(windows, start=1):
        _score_window(runner, ops, seq, tokens, acc)
    if acc.tokens == 0:
        raise TwinferError("no tokens were scored: give a longer corpus or more --tokens")
    experts = acc.mass / acc.tokens if spec.moe else None
    return Influence(acc.cos_gap / acc.tokens, experts, acc.tokens)


def _score_window(runner: OpsRunner, ops: Any, seq: int, tokens: list[int], acc: _Acc) -> None:
    bs = runner.kv.block_size
    table = list(range(-(-len(tokens) // bs)))
    ctx = ops.begin_step(StepBatch([SeqChunk(seq, tokens, 0, table, LogitsWanted.NONE)]))
    model, w = runner.model, runner.weights
    x = model.embed(ops, w, ctx)
    before = ops.to_host(x).astype(np.float64)
    for layer in range(runner.spec.num_layers):
        x = model.block(ops, w, f"layers.{layer}.", layer, x, ctx)
        after = ops.to_host(x).astype(np.float64)  # [T, C]
        dot = (before * after).sum(-1)
        norms = np.linalg.norm(before, axis=-1) * np.linalg.norm(after, axis=-1)
        acc.cos_gap[layer] += float((1.0 - dot / np.maximum(norms, 1e-30)).sum())
        before = after
    acc.tokens += len(tokens)
    runner.release(seq)


@dataclass(frozen=True)
class KLRanking:
    """Layers in the order greedy KL removal took them, and the mean KL after each removal."""

    removed: tuple[int, ...]
    kl: tuple[float, ...]  # KL(original || model without removed[: i + 1]), mean over the ranking's rows
    rows: int  # rows (tokens) every finalist is scored on


def rank_layers_by_kl(runner: Runner, windows: list[list[int]], n: int, stride: int = 4,
                      finalists: int = 3) -> KLRanking:
    """Remove `n` layers one at a time, each round the one that keeps KL to the full model lowest: screen
    every layer on every `stride`-th row, then score the `finalists` on all rows (per-row KL is
    heavy-tailed); hidden states are cached so trying layer j reruns only the layers after it."""
    if not isinstance(runner, OpsRunner):
        raise TwinferError("ranking layers by KL needs the torch or mlx backend (--backend torch)")
    L = runner.spec.num_layers
    if not 0 <= n < L:
        raise TwinferError(f"cannot remove {n} of {L} layers: keep at least one (0 <= --layers < {L})")
    refs = [_Reference.of(_window_logits(runner, seq, tokens)) for seq, tokens in enumerate(windows, start=1)]
    rows = sum(len(t) for t in windows)
    if rows == 0:
        raise TwinferError("no tokens were scored: give a longer corpus or more --tokens")
    removed: list[int] = []
    trail: list[float] = []
    for _ in range(n):
        left = [i for i in range(L) if i not in removed]
        screen = _summed_kl(runner, windows, refs, removed, left, stride)
        top = sorted(left, key=lambda i: (screen[i], i))[:finalists]
        full = _summed_kl(runner, windows, refs, removed, top, 1) if stride > 1 else screen
        best = min(top, key=lambda i: (full[i], i))
        removed.append(best)
        trail.append(full[best] / rows)
    return KLRanking(tuple(removed), tuple(trail), rows)


@dataclass(frozen=True)
class _Reference:
    """The full model's next-token distributions of one window: p [T, V] and sum(p log p) per row."""

    p: np.ndarray
    neg_entropy: np.ndarray

    @staticmethod
    def of(logits: np.ndarray) -> _Reference:
        from twinfer.quant.kl import log_softmax

        lp = log_softmax(logits)
        return _Reference(np.exp(lp).astype(np.float32), (np.exp(lp) * lp).sum(-1))

    def kl(self, logits: np.ndarray, rows: np.ndarray) -> float:
        """Summed KL(reference || softmax(logits)) over `rows`; `logits` are those rows' [R, V]."""
        x = np.asarray(logits, dtype=np.float32)
        top = x.max(-1, keepdims=True)
        lse = top[:, 0] + np.log(np.exp(x - top).sum(-1, dtype=np.float64))
        cross = (self.p[rows] * x).sum(-1, dtype=np.float64) - lse  # sum(p log q)
        return float((self.neg_entropy[rows] - cross).sum())


def _scored_rows(n_tokens: int, stride: int) -> np.ndarray:
    return np.arange(stride - 1, n_tokens, stride)


def _head(runner: OpsRunner, x: Any, rows: np.ndarray) -> np.ndarray:
    """Final norm and output matrix on the chosen rows of hidden states `x` [T, C]: logits [R, V]."""
    ops, w, spec = runner.ops, runner.weights, runner.spec
    picked = ops.weight("prune.rows", np.asarray(ops.to_host(x), dtype=np.float32)[rows])
    h = ops.rms_norm(picked, w["norm"], spec.rms_norm_eps)
    out: np.ndarray = ops.to_host(runner.model.logits(ops, w, h))
    return out


def _run_layers(runner: OpsRunner, x: Any, ctx: Any, layers: range, skip: Collection[int]) -> Any:
    for layer in layers:
        if layer not in skip:
            x = runner.model.block(runner.ops, runner.weights, f"layers.{layer}.", layer, x, ctx)
    return x


def _begin(runner: OpsRunner, seq: int, tokens: list[int]) -> Any:
    table = list(range(-(-len(tokens) // runner.kv.block_size)))
    return runner.ops.begin_step(StepBatch([SeqChunk(seq, tokens, 0, table, LogitsWanted.NONE)]))


def _window_logits(runner: OpsRunner, seq: int, tokens: list[int]) -> np.ndarray:
    ctx = _begin(runner, seq, tokens)
    x = runner.model.embed(runner.ops, runner.weights, ctx)
    x = _run_layers(runner, x, ctx, range(runner.spec.num_layers), ())
    out = _head(runner, x, np.arange(len(tokens)))
    runner.release(seq)
    return out


def _summed_kl(runner: OpsRunner, windows: list[list[int]], refs: list[_Reference], removed: list[int],
               candidates: list[int], stride: int) -> dict[int, float]:
    """KL(full || without removed + [j]) summed over every window's `stride`-th rows, per candidate j."""
    L = runner.spec.num_layers
    total = dict.fromkeys(candidates, 0.0)
    for seq, (tokens, ref) in enumerate(zip(windows, refs, strict=True), start=1):
        ctx = _begin(runner, seq, tokens)
        x = runner.model.embed(runner.ops, runner.weights, ctx)
        inputs = []  # the hidden states entering each layer, with `removed` skipped
        for layer in range(L):
            inputs.append(x)
            x = _run_layers(runner, x, ctx, range(layer, layer + 1), removed)
        rows = _scored_rows(len(tokens), stride)
        for j in candidates:
            y = _run_layers(runner, inputs[j], ctx, range(j + 1, L), removed)
            total[j] += ref.kl(_head(runner, y, rows), rows)
        runner.release(seq)
    return total


@dataclass(frozen=True)
class PruneResult:
    """What `prune_model` removed, where it wrote the model, and what it costs in KL."""

    source: str
    out: str
    removed_layers: tuple[int, ...]
    kept_layers: tuple[int, ...]
    removed_experts: int
    influence: tuple[float, ...]
    scored_tokens: int
    kl: Any = None  # a quant.kl.KLReport, when measured
    rank: str = "influence"  # how layers were chosen: "kl" (greedy, measured) or "influence"
    rank_kl: tuple[float, ...] = ()  # rank "kl": the ranking's mean KL after each removal, in removal order

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "kl"}
        out["kl"] = self.kl.as_dict() if self.kl is not None else None
        return out

    def lines(self) -> list[str]:
        if not self.removed_layers:
            how = "  removed no layers"
        elif self.rank == "kl":
            how = (f"  removed layers {list(self.removed_layers)} (greedy by KL; after each removal: "
                   + ", ".join(f"{v:.4f}" for v in self.rank_kl) + " nats on the ranking rows)")
        else:
            how = (f"  removed layers {list(self.removed_layers)} (block influence "
                   + ", ".join(f"{self.influence[i]:.4f}" for i in self.removed_layers) + ")")
        lines = [f"pruned {self.source} -> {self.out}", how]
        if self.removed_experts:
            lines.append(f"  removed {self.removed_experts} experts per MoE layer (least routing mass)")
        if self.kl is not None:
            lines += self.kl.lines()
        return lines


def output_path(source: Path, out: Path, fmt: str, n_layers: int) -> Path:
    """Where the pruned model goes: a .gguf `--out` is the file; otherwise a file or folder inside it."""
    if fmt == "gguf":
        if out.suffix == ".gguf":
            return out
        out.mkdir(parents=True, exist_ok=True)
        return out / f"{source.stem}-{n_layers}L.gguf"
    return out


RANKS = ("kl", "influence")


@dataclass(frozen=True)
class PruneOptions:
    """What `prune_model` removes and how it ranks and judges (`twinfer prune`'s flags)."""

    layers: int = 0  # transformer blocks to remove
    experts: int = 0  # routed experts to remove per MoE layer
    corpus: str = "prose"  # where layers are ranked
    tokens: int = 512
    window: int = 256
    backend: str = "torch"  # the backend that measures influence
    kl_tokens: int = 512  # tokens for KL(original || pruned); 0 skips it
    kl_reference: str | None = None
    rank: str = "kl"  # kl (greedy, each removal the one that keeps KL lowest) or influence (one pass)

    def __post_init__(self) -> None:
        if self.rank not in RANKS:
            raise TwinferError(f"unknown --rank {self.rank!r}: use one of {', '.join(RANKS)}", field="rank")
        if self.layers < 0 or self.experts < 0:
            raise TwinferError("--layers and --experts count what to remove: give numbers >= 0",
                               field="layers" if self.layers < 0 else "experts")
        if self.layers == 0 and self.experts == 0:
            raise TwinferError("nothing to prune: give --layers N and/or --experts N", field="layers")


def prune_model(model: str | None, out: str, options: PruneOptions, *, runners: RunnerFactory) -> PruneResult:
    """Rank layers on the corpus (`rank`: greedy KL or block influence), remove `layers` blocks and
    `experts` experts per MoE layer (least routing mass), write the model next to `out`, and report
    KL(original || pruned) on `kl_tokens` tokens (0: skip). `runners` opens the model to rank it."""
    from twinfer.quant.fidelity import corpus_windows, measure_kl
    from twinfer.quant.prune_write import write_pruned_gguf, write_pruned_hf
    from twinfer.runtime.loaders import load_model
    from twinfer.runtime.model_path import resolve_path

    o = options
    layers, experts, corpus, tokens, window = o.layers, o.experts, o.corpus, o.tokens, o.window
    backend, kl_tokens, kl_reference, rank = o.backend, o.kl_tokens, o.kl_reference, o.rank
    src = resolve_path(model)
    loaded = load_model(src)
    spec = loaded.spec
    if layers >= spec.num_layers:
        raise TwinferError(f"cannot remove {layers} of {spec.num_layers} layers: keep at least one "
                           f"(0 <= --layers < {spec.num_layers})")
    if experts and spec.moe is None:
        raise TwinferError("--experts prunes routed experts, and this model has none")
    if spec.moe is not None and experts >= spec.moe.num_experts - spec.moe.top_k + 1:
        raise TwinferError(f"cannot remove {experts} of {spec.moe.num_experts} experts: keep at least top_k="
                           f"{spec.moe.top_k}")
    windows = list(corpus_windows(model, corpus, tokens, window))
    runner = runners.open(model, backend, max_seqs=2, ctx=max(256, window + 16))
    influence = measure_influence(runner, windows)
    ranking = rank_layers_by_kl(runner, windows, layers) if rank == "kl" and layers else None
    del runner
    removed = sorted(ranking.removed) if ranking is not None else influence.layers_to_remove(layers)
    keep = [i for i in range(spec.num_layers) if i not in removed]
    keep_experts = {i: e for i, e in influence.experts_to_keep(experts).items() if i in keep} if experts else {}
    dest = output_path(src, Path(out).expanduser(), loaded.format, len(keep))
    if loaded.format == "gguf":
        write_pruned_gguf(src, dest, spec, keep, keep_experts)
    else:
        write_pruned_hf(src, dest, keep, keep_experts)
    load_model(dest)  # the written model must load: fail here, not in the user's next command
    report = None
    if kl_tokens > 0:
        ref = kl_reference or ("llamacpp" if loaded.format == "gguf" else backend)
        report = measure_kl(model, ref, str(dest), corpus, kl_tokens, window, runners=runners)
    return PruneResult(str(src), str(dest), tuple(removed), tuple(keep), experts,
                       tuple(float(v) for v in influence.layers), influence.tokens, report,
                       rank, ranking.kl if ranking is not None else ())
