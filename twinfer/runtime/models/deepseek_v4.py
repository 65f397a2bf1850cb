"""DeepSeek-V4 (`deepseek_v4`, Flash and Pro): recognised, not run yet, and refused naming what is missing.

A V4 decoder layer differs from DeepSeek-V3.2's (deepseek_v32.py) in four places, none of which the
`Ops` interface, the KV accounting or the loaders hold today (docs/architecture.md, "DeepSeek-V4",
describes how each would be built on what exists):

- the residual is `hc_mult` streams (manifold-constrained hyper-connections): before each attention
  and MoE block a learned projection of the normalized streams gives collapse ("pre"), expand
  ("post") and mixing ("comb", Sinkhorn-projected to a doubly-stochastic matrix) weights;
- attention has one shared K = V head of 512 (rope on its last 64 dims, undone on the output),
  learned sinks and a 128-token window, and a grouped low-rank output projection;
- beside the window, CSA layers attend over KV pooled 4:1 with overlapping gated windows, whose
  entries a lightning indexer picks top-k, and HCA layers over KV pooled 128:1: caches that grow by
  one entry every m tokens and carry a partial window per sequence;
- the first `mlp_layer_types == "hash_moe"` layers route by a frozen token-id -> experts table,
  and every router scores with sqrt(softplus).

`refusal()` is what `twinfer generate`, `eval kl`, `plan` and `serve` print for such a folder.
"""

from __future__ import annotations

MISSING = (
    "hyper-connections (hc_mult residual streams mixed by Sinkhorn-projected weights)",
    "compressed KV caches (CSA: 4:1 gated pooling with its lightning indexer; HCA: 128:1)",
    "one shared K=V head with rope undone on the output and a grouped low-rank output projection",
    "hash routing by token id in the first layers and sqrt-softplus router scores",
)


def refusal() -> str:
    """One line: what twinfer lacks to run DeepSeek-V4."""
    return f"DeepSeek-V4 (model_type 'deepseek_v4') does not run in twinfer yet; it needs {'; '.join(MISSING)}"
