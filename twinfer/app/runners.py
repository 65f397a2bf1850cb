"""The runners quant's measuring harness asks for (`quant.fidelity.RunnerFactory`): `RUNNERS` builds
them where every other runner is built (`app/models.py`), so quant imports no backend."""

from __future__ import annotations

from typing import Any

from twinfer.app.models import build_in_memory, open_model
from twinfer.runtime.runner import Runner
from twinfer.runtime.spec import ModelSpec


class AppRunners:
    """`quant.fidelity.RunnerFactory` over the app's backends."""

    def open(self, model: str | None, backend: str, *, max_seqs: int, ctx: int, **options: Any) -> Runner:
        """`model` (None: the default) on `backend`; `options` are further `RunnerOptions` fields (e.g. `kv_type`)."""
        return open_model(model, backend, max_seqs=max_seqs, ctx=ctx, **options).runner

    def build(self, backend: str, spec: ModelSpec, weights: Any, *, kv_tokens: int,
              kv_format: str | None = None) -> Runner:
        """A torch or MLX runner over weights held in memory (a quantized view included)."""
        return build_in_memory(backend, spec, weights, kv_tokens=kv_tokens, kv_format=kv_format)


RUNNERS = AppRunners()
