"""`--memory-budget` on a GGUF MoE bigger than the budget: page its experts from the file, or requantize.
Paging (lossless, reads from disk; backends/llamacpp/paging.py) and a requantized file that fits whole
are scored as every plan is (speed discounted by expected KL); the summary names the winner and the other."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from twinfer.app.budget import _FTYPES, LocalStrategy
from twinfer.runtime.loaders import LoadedModel

if TYPE_CHECKING:
    from twinfer.planners.calibration import Calibration
    from twinfer.planners.hardware import Cluster
    from twinfer.planners.search import Candidate, Request

KV_SHARE = 1 / 8  # a context nobody asked for may take at most this share of the budget in KV cache
CELLS = 256  # llama.cpp rounds its cache up to a multiple of 256 cells


def fitting_context(loaded: LoadedModel, budget: int, ctx: int, kv_bytes: float = 2.0) -> tuple[int, tuple[str, ...]]:
    """The default context `ctx`, shrunk (in steps of 256 tokens, at least 256) until its F16 KV cache is at
    most `KV_SHARE` of `budget`; and the reason, when it shrank."""
    per_token = loaded.spec.kv_bytes_per_token(kv_bytes)
    if ctx * per_token <= KV_SHARE * budget:
        return ctx, ()
    fit = max(CELLS, int(KV_SHARE * budget / per_token) // CELLS * CELLS)
    if fit >= ctx:
        return ctx, ()
    return fit, (f"Context {fit} tokens (KV cache about {fit * per_token / 1e6:.0f} MB): the default {ctx} tokens "
                 f"would hold {ctx * per_token / 1e6:.0f} MB of a {budget / 1e6:.0f} MB budget; pass --ctx to "
                 "choose another",)


def paged_or_requantized(paged: Candidate, cluster: Cluster, request: Request, budget: int) -> LocalStrategy:
    """The better-scoring of `paged` (the planner's plan keeping part of the stored experts resident) and the
    best requantized file that fits whole at a good tier, as a strategy with the reason for the choice."""
    from twinfer.planners.calibration import Calibration
    from twinfer.planners.formats import GOOD
    from twinfer.planners.search import enumerate_strategies, evaluate, score, target_of

    cal = Calibration()
    paged = _stored(paged, cluster, request, cal)
    pairs = enumerate_strategies(paged.profile, cluster, request, target_of(cluster), requantize=True)
    whole = [c for c in (evaluate(p, cluster, s, request, cal) for s, p in pairs)
             if c.fits and not c.strategy.stream_fraction and c.tier <= GOOD
             and c.strategy.mix.quantizer_mix in _FTYPES and c.strategy.engine == "llamacpp"]
    best = max(whole, key=score, default=None)
    why: tuple[str, ...]
    page_tps = 1.0 / paged.single.latency_s
    if best is not None and score(best) > score(paged):
        tps, m = 1.0 / best.single.latency_s, best.strategy.mix
        why = (f"The stored file needs {paged.memory.weights_bytes / 1e6:.0f} MB; requantized to {m.label or m.name} "
               f"it fits whole and decodes at about {tps:.1f} tok/s, against {page_tps:.1f} tok/s paging the stored "
               f"experts from disk (lossless), for about {best.kl:.4f} nats of KL",)
        return _requantized(best, budget, why)
    s, mem, moe = paged.strategy, paged.memory, paged.profile.moe
    assert moe is not None
    routed = paged.profile.expert_bytes(s.mix) * paged.profile.moe_layers * moe.num_experts
    bound = max(0, int(routed - mem.streamed_weights))
    # the pager makes room layer by layer (paging.py): a prompt maps all of one layer's experts at once
    step_touch = max(bound, int(routed / paged.profile.moe_layers))
    why = (f"Every weight resident would need {mem.weights_bytes / 1e6:.0f} MB; at batch 1 a token reads its "
           f"top-{moe.top_k} of {moe.num_experts} experts per layer, so the stored file is paged (lossless, "
           f"about {page_tps:.1f} tok/s predicted, reads from disk)",)
    if best is not None:
        why += (f"Requantized to {best.strategy.mix.label or best.strategy.mix.name} it would fit whole at about "
                f"{1.0 / best.single.latency_s:.1f} tok/s for about {best.kl:.4f} nats of KL",)
    return LocalStrategy(budget, "llamacpp", "as stored, paged from the file", s.kv.label, kv_type=s.kv.name,
                         expert_cache_bytes=bound, predicted_bytes=int(mem.used - mem.overhead) + step_touch - bound, reasons=why, expected_kl=paged.kl)


def _stored(paged: Candidate, cluster: Cluster, request: Request, cal: Calibration) -> Candidate:
    """The plan with the stored file streamed, as the pager runs it: the planner's streamed plan may be a
    requantized one (its bound and bytes would then be another format's). The best-scoring share that fits,
    else the one that streams most."""
    from twinfer.planners.search import STREAM_SHARES, evaluate, score

    stored = paged.profile.stored
    if stored is None or paged.strategy.mix == stored:
        return paged
    options = [evaluate(paged.profile, cluster, replace(paged.strategy, mix=stored, stream_fraction=share), request, cal)
               for share in STREAM_SHARES]
    return max([c for c in options if c.fits], key=score, default=options[-1])


def _requantized(c: Candidate, budget: int, why: tuple[str, ...]) -> LocalStrategy:
    s = c.strategy
    embed = c.profile.split(s.mix, "embed")[0][0] if s.mix.embed_type else None
    return LocalStrategy(budget, "llamacpp", s.mix.label or s.mix.name, s.kv.label, kv_type=s.kv.name,
                         requantize=s.mix.quantizer_mix, embed_type=embed, predicted_bytes=int(c.memory.used - c.memory.overhead),
                         reasons=why, expected_kl=c.kl)
