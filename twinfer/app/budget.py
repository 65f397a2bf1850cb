"""`--memory-budget`: ask for a local strategy that fits, apply it, and say what was chosen.
llama.cpp: the planner picks weight format and KV type for a device whose memory is the budget
(requantized by llama.cpp's quantizer; pruning only with `allow_pruning`). torch / MLX: exact byte
counts decide here: default dtype, half precision, experts streamed at batch 1, then pruning."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from twinfer.app.models import RunnerOptions
from twinfer.runtime.cache_dir import cache_dir
from twinfer.runtime.errors import PlanError
from twinfer.runtime.experts import expert_params, plan_expert_budget
from twinfer.runtime.loaders import LoadedModel, load_model

if TYPE_CHECKING:
    from twinfer.app.budget_kl import MeasuredKL
    from twinfer.planners.hardware import Cluster
    from twinfer.planners.placement import Placement

# mix name -> llama.cpp LLAMA_FTYPE_* attribute of the formats the llama.cpp quantizer writes
_FTYPES = {"f16": "MOSTLY_F16", "q8_0": "MOSTLY_Q8_0", "q6_k": "MOSTLY_Q6_K", "q5_k_m": "MOSTLY_Q5_K_M",
           "q4_k_m": "MOSTLY_Q4_K_M", "q4_0": "MOSTLY_Q4_0", "iq4_xs": "MOSTLY_IQ4_XS",
           "q3_k_m": "MOSTLY_Q3_K_M", "q2_k": "MOSTLY_Q2_K"}


@dataclass(frozen=True)
class LocalStrategy:
    """What `--memory-budget` chose, in terms a runner applies."""

    budget: int
    backend: str
    weights: str  # "as stored", a GGUF mix, or the runner dtype
    kv: str
    dtype: str | None = None  # torch / MLX runner dtype
    kv_type: str | None = None  # llama.cpp cache type
    requantize: str | None = None  # GGUF mix to requantize to
    embed_type: str | None = None  # llama.cpp type for the token embedding / output when requantizing
    expert_cache_bytes: int | None = None
    placement: Placement | None = None  # llama.cpp: the plan's GPU layers, host-memory experts and KV type
    prune_layers: int = 0
    ctx: int | None = None  # llama.cpp: the context chosen when none was asked for (budget_gguf.fitting_context)
    predicted_bytes: int = 0
    reasons: tuple[str, ...] = field(default_factory=tuple)
    expected_kl: float | None = None
    measured_kl: MeasuredKL | None = None  # llama.cpp: what the lossy choice costs on a fixed text (budget_kl.py)

    @property
    def lossy(self) -> bool:
        """Whether the run differs from the stored model: a new file or a quantized KV cache."""
        return bool(self.requantize or self.prune_layers) or self.kv_type not in (None, "f16")

    def runner_options(self, base: RunnerOptions) -> RunnerOptions:
        """`base` with this strategy's choices; the plan's one shared KV cache of `ctx` tokens, except that a
        batch-invariant mode still gets its per-sequence streams."""
        return replace(base, backend=self.backend, kv_type=self.kv_type, dtype=self.dtype,
                       expert_cache_bytes=self.expert_cache_bytes, placement=self.placement, kv_layout="unified")

    def summary(self) -> str:
        """One paragraph: what was chosen, what it costs, and why."""
        mb = 1e6
        parts = [f"memory budget {self.budget / mb:.0f} MB: running {self.backend} with weights {self.weights}, "
                 f"KV cache {self.kv}"]
        if self.placement is not None and self.placement.offloads:
            parts.append(f"llama.cpp {self.placement.args()}")
        if self.requantize:
            embed = (f", token embedding and output matrix in {self.embed_type.upper()}" if self.embed_type
                     else "")
            parts.append(f"requantized by llama.cpp to {self.requantize.upper()}{embed}")
        if self.expert_cache_bytes is not None and self.backend == "llamacpp":
            parts.append(f"the file mapped, dense weights resident, at most {self.expert_cache_bytes / mb:.0f} MB of "
                         "routed-expert pages kept, the rest read ahead from the file as each layer's router picks them")
        elif self.expert_cache_bytes is not None:
            parts.append(f"routed experts streamed from the file through a {self.expert_cache_bytes / mb:.0f} MB "
                         "LRU cache with next-layer prefetch")
        if self.prune_layers:
            parts.append(f"{self.prune_layers} least influential layers pruned")
        on_top = ", the interpreter's ~150 MB on top" if self.backend == "llamacpp" else ""
        text = "; ".join(parts) + f" (about {self.predicted_bytes / mb:.0f} MB{on_top})."
        if self.reasons:
            text += " " + " ".join(r.rstrip(".") + "." for r in self.reasons)
        if self.measured_kl is not None:
            text += " " + self.measured_kl.line(self.expected_kl)
        elif self.expected_kl is not None:
            text += f" Expected KL against the unconstrained model: about {self.expected_kl:.4f} nats."
        return text


def parse_budget(text: str | int) -> int:
    """`--memory-budget` in bytes (`12GB`, `800MiB` or a number)."""
    from twinfer.planners.units import parse_bytes

    budget = parse_bytes(text)
    if budget <= 0:
        raise PlanError(f"--memory-budget must be positive, got {text!r}", field="memory_budget")
    return budget


def _ops_bytes(loaded: LoadedModel, dtype_bytes: int, ctx: int, max_seqs: int = 1) -> int:
    spec, w = loaded.spec, loaded.weights
    total = 0
    for name in w.names():
        if name == "lm_head" and spec.tie_word_embeddings:
            continue
        total += math.prod(w.shape(name)) * dtype_bytes
    kv = ctx * spec.num_layers * 2 * spec.kv_size * dtype_bytes
    act = 512 * 16 * spec.hidden_size * 4 + max_seqs * spec.vocab_size * 4  # a prefill chunk, a row of logits each
    return total + kv + act


def ops_strategy(loaded: LoadedModel, backend: str, budget: int, ctx: int, max_seqs: int,
                 allow_pruning: bool) -> LocalStrategy:
    """The torch/MLX strategy for `budget`, most faithful first: float32; float32 with experts
    streamed (lossless, batch 1); half precision (rounding); half precision with layers pruned."""
    spec = loaded.spec
    half = "bfloat16"  # float16 overflows in Gemma-style activations (NaN logits on MLX in our runs)
    need32 = _ops_bytes(loaded, 4, ctx, max_seqs)
    if need32 <= budget:
        return LocalStrategy(budget, backend, "float32", "float32", dtype="float32", predicted_bytes=need32)
    if spec.moe is not None:
        split = plan_expert_budget(loaded.weights, budget, 4, ctx)
        per_expert = expert_params(spec) * 4
        if split.cache_bytes >= spec.moe.top_k * per_expert:
            why: tuple[str, ...] = (f"Every expert resident would need {need32 / 1e6:.0f} MB; a token reads only "
                                    f"its top-{spec.moe.top_k} experts per layer, so the rest stay in the file "
                                    "(lossless).",)
            if max_seqs > 1:
                why += ("Steps with several sequences reach most experts and run slower than batch 1.",)
            return LocalStrategy(budget, backend, "float32", "float32", dtype="float32",
                                 expert_cache_bytes=split.cache_bytes, predicted_bytes=budget, reasons=why)
    need16 = _ops_bytes(loaded, 2, ctx, max_seqs)
    if need16 <= budget:
        why = (f"float32 weights need {need32 / 1e6:.0f} MB, so they are held in {half} (rounding only).",)
        return LocalStrategy(budget, backend, half, half, dtype=half, predicted_bytes=need16, reasons=why)
    per_layer = _layer_bytes(loaded, 2)
    drop = -(-(need16 - budget) // max(1, per_layer))
    if allow_pruning and 0 < drop <= spec.num_layers // 2:
        why = (f"Even {half} needs {need16 / 1e6:.0f} MB, so the {drop} least influential layers are removed "
               "(lossy: see `twinfer prune`).",)
        return LocalStrategy(budget, backend, half, half, dtype=half, prune_layers=int(drop),
                             predicted_bytes=need16 - int(drop) * per_layer, reasons=why)
    hint = "" if allow_pruning else " (or allow pruning with --allow-pruning)"
    raise PlanError(f"{spec.name or 'the model'} needs {need16 / 1e6:.0f} MB even in {half}; --memory-budget is "
                    f"{budget / 1e6:.0f} MB: raise it{hint}")


def _layer_bytes(loaded: LoadedModel, dtype_bytes: int) -> int:
    w = loaded.weights
    return sum(math.prod(w.shape(n)) * dtype_bytes for n in w.names() if n.startswith("layers.0."))


def llamacpp_strategy(loaded: LoadedModel, budget: int, ctx: int, max_seqs: int, allow_pruning: bool,
                      hardware: Cluster | None = None) -> LocalStrategy:
    """Ask the planner for a llama.cpp plan on `hardware` (default: the probed host) with `budget` of memory."""
    from twinfer.planners.memory import LOCAL_OVERHEAD
    from twinfer.planners.plan import make_plan
    from twinfer.planners.search import Request
    from twinfer.planners.source import profile_from_loaded

    # the budget is the model's (weights, KV, buffers); the interpreter's share the planner adds comes on top
    cluster = replace(hardware or _host(), memory_budget_bytes=budget + LOCAL_OVERHEAD)
    profile = profile_from_loaded(loaded)
    plan = make_plan(profile, cluster, Request(ctx, max_seqs))
    offloads = plan.placement is not None and plan.placement.offloads  # on a GPU the rest stay in host RAM, not paged
    if plan.chosen is not None and plan.chosen.strategy.stream_fraction and not offloads:  # a lossless paged plan, or a smaller file
        from twinfer.app.budget_gguf import paged_or_requantized

        return _on_cpu(paged_or_requantized(plan.chosen, cluster, Request(ctx, max_seqs), budget), plan.placement)
    if not plan.fits or plan.chosen is None:
        one = make_plan(profile, cluster, Request(ctx, 1)) if max_seqs > 1 else None  # only batch 1 streams experts
        alone = (f"; or compute one request at a time (--max-seqs 1): {one.chosen.strategy.label()} fits"
                 if one is not None and one.fits and one.chosen is not None else "")
        raise PlanError(f"nothing fits --memory-budget {budget / 1e6:.0f} MB: {plan.suggestion}{alone}")
    s = plan.chosen.strategy
    if s.engine != "llamacpp":
        raise PlanError(f"the plan for this budget runs on {s.engine}; pass --backend {s.engine}")
    if s.prune and not allow_pruning:
        raise PlanError(f"only a pruned model fits --memory-budget {budget / 1e6:.0f} MB ({s.label()}); "
                        "allow it with --allow-pruning, or raise the budget")
    requant = None if s.mix.name == "stored" else s.mix.quantizer_mix
    if requant is not None and requant not in _FTYPES:
        raise PlanError(f"the plan chose {s.mix.label or s.mix.name}, which llama.cpp's quantizer does not write")
    # the type the planner priced the embedding at: a K-quant falls back on rows its blocks do not divide
    embed = plan.chosen.profile.split(s.mix, "embed")[0][0] if s.mix.embed_type else None
    return LocalStrategy(budget, "llamacpp", s.mix.label or s.mix.name, s.kv.label, kv_type=s.kv.name,
                         requantize=requant, embed_type=embed, placement=plan.placement,
                         prune_layers=round(loaded.spec.num_layers * s.prune),
                         predicted_bytes=int(plan.chosen.memory.used - LOCAL_OVERHEAD), reasons=plan.reasons[:1],
                         expected_kl=plan.chosen.kl)


def _on_cpu(strategy: LocalStrategy, placement: Placement | None) -> LocalStrategy:
    """A CPU plan's strategy with the plan's placement (no layer on a GPU, whatever the build) at the KV type
    the strategy chose."""
    if placement is None:
        return strategy
    return replace(strategy, placement=replace(placement, kv_type=strategy.kv_type or "f16"))


def _host() -> Cluster:
    """This machine for a llama.cpp budget: its local GPU or Apple silicon where the installed build runs on
    it (the plan's placement then offloads), else its CPU, which every build runs."""
    from twinfer.planners.describe import resolve_cluster
    from twinfer.planners.probe import probe_cpu
    from twinfer.planners.search import target_of

    found = resolve_cluster("auto")
    usable = found.device.kind == "cpu" or found.llamacpp_build is not None
    return found if usable and target_of(found) == "local" else probe_cpu()


@dataclass(frozen=True)
class BudgetRequest:
    """What a memory budget is planned for: `budget` bytes for `max_seqs` sequences of `ctx` tokens."""

    budget: int
    ctx: int
    max_seqs: int = 1
    allow_pruning: bool = False
    threads: int | None = None  # the quantizer's, when the plan requantizes
    hardware: Cluster | None = None  # what the plan is made on; None: the probed host
    ctx_given: bool = True  # False: `ctx` is a default that llama.cpp's plan may shrink to fit


def fit_budget(path: Path, loaded: LoadedModel, backend: str,
               request: BudgetRequest) -> tuple[LocalStrategy, Path, LoadedModel]:
    """The strategy for the model at `path` on `backend` (a chosen one) under `request`, with its
    transforms applied: the strategy, the file to run (pruned, requantized or as stored) and its model."""
    r = request
    if backend == "llamacpp":
        from twinfer.app.budget_gguf import fitting_context

        ctx, why = (r.ctx, ()) if r.ctx_given else fitting_context(loaded, r.budget, r.ctx)
        strategy = llamacpp_strategy(loaded, r.budget, ctx, r.max_seqs, r.allow_pruning, r.hardware)
        strategy = replace(strategy, ctx=ctx, reasons=strategy.reasons + why)
    else:
        strategy = ops_strategy(loaded, backend, r.budget, r.ctx, r.max_seqs, r.allow_pruning)
    run_path = path
    if strategy.prune_layers:
        run_path = _pruned(path, strategy.prune_layers, strategy.backend)
    if strategy.requantize:
        from twinfer.backends.llamacpp.requantize import requantize_in_child

        run_path = requantize_in_child(run_path, strategy.requantize, _FTYPES[strategy.requantize], r.threads,
                                       embed_type=strategy.embed_type)
    if strategy.backend == "llamacpp" and strategy.lossy:
        from twinfer.app.budget_kl import measured_kl

        bound = strategy.expert_cache_bytes if strategy.expert_cache_bytes is not None else r.budget // 2
        strategy = replace(strategy, measured_kl=measured_kl(path, run_path, strategy.kv_type, bound, r.threads))
    return strategy, run_path, load_model(run_path) if run_path != path else loaded


def _pruned(path: Path, layers: int, backend: str) -> Path:
    from twinfer.app.runners import RUNNERS
    from twinfer.quant.prune import PruneOptions, prune_model

    options = PruneOptions(layers=layers, backend="torch" if backend == "llamacpp" else backend, kl_tokens=0, rank="kl")
    return Path(prune_model(str(path), str(cache_dir("pruned") / f"{path.stem}-minus{layers}-kl"), options,
                            runners=RUNNERS).out)
