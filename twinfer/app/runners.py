"""The runners quant's measuring harness asks for (`quant.fidelity.RunnerFactory`), opened by the app.

quant scores models (KL, sensitivities, pruning ranks) without importing a backend: whoever calls it
hands it `RUNNERS`, and this is the one place that turns "torch over these weights" into a runner.
"""

from __future__ import annotations

from typing import Any

from twinfer.app.models import open_model
from twinfer.runtime.errors import TwinferError
from twinfer.runtime.runner import Runner
from twinfer.runtime.spec import ModelSpec


class AppRunners:
    """`quant.fidelity.RunnerFactory` over the app's backends."""

    def open(self, model: str | None, backend: str, *, max_seqs: int, ctx: int, **options: Any) -> Runner:
        """`model` (None: the default) on `backend`; `options` go to the llama.cpp runner (e.g. `kv_type`)."""
        if options and backend != "llamacpp":
            raise TwinferError(f"runner options {options} apply to the llamacpp backend, not {backend}")
        return open_model(model, backend, max_seqs=max_seqs, ctx=ctx, runner_options=options or None).runner

    def build(self, backend: str, spec: ModelSpec, weights: Any, *, kv_tokens: int,
              kv_format: str | None = None) -> Runner:
        """A torch or MLX runner over weights held in memory (a quantized view included)."""
        if backend == "torch":
            from twinfer.backends.cuda.runner import build_torch_runner

            return build_torch_runner(spec, weights, kv_tokens=kv_tokens, kv_format=kv_format)
        if backend == "mlx":
            from twinfer.backends.metal.runner import build_mlx_runner

            return build_mlx_runner(spec, weights, kv_tokens=kv_tokens, kv_format=kv_format)
        raise TwinferError(f"runners over in-memory weights run on torch or mlx, not {backend}")


RUNNERS = AppRunners()
