"""DeepSeek-V4 (`deepseek_v4`, Flash and Pro): recognised, not run yet, and refused naming what is missing.
`refusal()` is what `twinfer generate`, `eval kl`, `plan` and `serve` print for such a folder; what V4
needs beyond V3.2: docs/architecture.md, "DeepSeek-V4: what it needs"."""

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
