"""The doctor's built-in stages (app/doctor_stages.py says what a stage is). Each builder returns a
`Stage` whose work is lazy, or one that says why it does not apply here (`note="skip: ..."`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from twinfer.app import doctor_stages as ds
from twinfer.runtime.errors import TwinferError

FP32_KERNELS = ds.Allowance(1e-6, True, "lossless, fp32 in other kernels")


def _skip(name: str, base: str | None, allowance: ds.Allowance, why: str) -> ds.Stage:
    return ds.Stage(name, base, allowance, note=f"skip: {why}")


def _fault_layer(fault: tuple[str, int] | None, name: str) -> int | None:
    return fault[1] if fault is not None and fault[0] == name else None


def reference(path: Path) -> ds.Stage:
    name = "reference"
    why = ds.available("transformers") or ds.available("torch")
    if why:
        return _skip(name, None, FP32_KERNELS, why)
    what = "transformers fp32, GGUF dequantized" if path.is_file() else "transformers fp32 (safetensors)"

    def logits(tokens: list[int]) -> np.ndarray:
        from twinfer.quant.fidelity import TransformersSource

        return TransformersSource(path).logits(tokens)

    return ds.Stage(name, None, ds.Allowance(None, False, what), logits=logits, note=what)


def graph(path: Path, backend: str, ctx: int, base: str, fault: tuple[str, int] | None) -> ds.Stage:
    """twinfer's own graph on `backend` in fp32; `fault` may perturb one of its layers (tests)."""
    why = ds.available(backend)
    if why:
        return _skip(backend, base, FP32_KERNELS, why)
    layer = _fault_layer(fault, backend)

    def logits(tokens: list[int]) -> np.ndarray:
        return ds.runner_logits(ds.graph_runner(path, backend, ctx, layer))(tokens)

    return ds.Stage(backend, base, FP32_KERNELS, logits=logits,
                    note=f"injected fault: layer {layer} output x1.5" if layer is not None else "")


def llamacpp(path: Path, ctx: int, base: str) -> ds.Stage:
    name = "llama.cpp"
    why = ds.available("llamacpp")
    if why:
        return _skip(name, base, ds.LLAMA_CPP, why)

    def logits(tokens: list[int]) -> np.ndarray:
        from twinfer.app.models import open_model

        return ds.runner_logits(open_model(str(path), "llamacpp", max_seqs=2, ctx=ctx).runner)(tokens)

    return ds.Stage(name, base, ds.LLAMA_CPP, logits=logits)


def budget(path: Path, memory_budget: str, ctx: int, base: str) -> ds.Stage:
    """What `--memory-budget` opens: the planner's weight mix and KV type, within its expected KL."""
    from twinfer.app.session import OpenOptions, open_session

    name = f"budget {memory_budget}"
    backend = "llamacpp" if path.is_file() else "auto"
    session = open_session(OpenOptions(str(path), backend, max_seqs=2, ctx=ctx, memory_budget=memory_budget))
    strategy = session.strategy
    expected = strategy.expected_kl if strategy is not None else None
    allowance = (ds.Allowance(2 * expected, False, f"quantization: 2x the planner's expected KL {expected:.4f}")
                 if expected else ds.Allowance(1e-6, True, "the budget kept the model as it is: lossless"))
    note = strategy.summary() if strategy is not None else ""
    return ds.Stage(name, base, allowance, logits=ds.runner_logits(session.opened.runner), note=note)


def parallel(path: Path, spec: Any, ctx: int, base: str) -> list[ds.Stage]:
    """TP=2 where the KV heads split, EP=2 for mixture-of-experts models: gloo ranks, one process each."""
    from twinfer.backends.cuda.parallel.layout import ParallelConfig

    out = []
    wanted = [("TP=2 (gloo)", (2, 1, 1))] if spec.num_kv_heads >= 2 or spec.moe is not None else []
    if spec.moe is not None:
        wanted.append(("EP=2 (gloo)", (1, 2, 1)))
    for name, (tp, ep, pp) in wanted:
        try:
            ParallelConfig(tp=tp, ep=ep, pp=pp).check(spec)
        except TwinferError as exc:
            out.append(_skip(name, base, ds.SAME_ARITHMETIC, str(exc)))
            continue

        def logits(tokens: list[int], degrees: tuple[int, int, int] = (tp, ep, pp)) -> np.ndarray:
            from twinfer.app.models import open_model

            runner = open_model(str(path), "torch", max_seqs=2, ctx=ctx, dtype="float32", parallel=degrees).runner
            try:
                return ds.runner_logits(runner)(tokens)
            finally:
                getattr(runner, "close", lambda: None)()

        out.append(ds.Stage(name, base, FP32_KERNELS, logits=logits, note="all-reduce sums in another order"))
    if not wanted:
        out.append(_skip("TP=2 (gloo)", base, FP32_KERNELS,
                         f"{spec.num_kv_heads} KV head and no experts: nothing worth splitting"))
    return out


def batched(path: Path, backend: str, ctx: int, fault: tuple[str, int] | None) -> ds.Stage:
    """The tokens in one step with another sequence, against the same graph alone."""
    name = f"{backend} batched"
    layer = _fault_layer(fault, name)

    def logits(tokens: list[int]) -> np.ndarray:
        return ds.batched_logits(ds.graph_runner(path, backend, 2 * ctx, layer))(tokens)

    return ds.Stage(name, backend, ds.SAME_ARITHMETIC, logits=logits)


def speculative(path: Path, backend: str, ctx: int) -> list[ds.Stage]:
    """Greedy output with ngram speculation against without, on the backend a user gets."""
    from twinfer.app.doctor import SPEC_TOKENS

    plain, spec = f"{backend} greedy", f"{backend} + ngram speculation"

    def run(speculate: str) -> Any:
        def generate(tokens: list[int]) -> list[int]:
            from twinfer.app.session import OpenOptions, open_session
            from twinfer.runtime.engine import GuardConfig, SamplingParams

            # speculation verifies on llama.cpp's row-invariant (unrepacked) weights; the plain run uses the same
            session = open_session(OpenOptions(str(path), backend, max_seqs=1, ctx=ctx, speculate=speculate,
                                               mode="row-invariant"))
            params = SamplingParams(max_tokens=SPEC_TOKENS, temperature=0.0, ignore_eos=True,
                                    guard=GuardConfig(enabled=False))
            try:
                return list(session.engine().generate([tokens], params)[0].token_ids)
            finally:
                session.close()

        return generate

    note = "both on unrepacked weights (what speculation verifies on)" if backend == "llamacpp" else ""
    return [ds.Stage(plain, None, ds.Allowance(None, False, "generation, the base of the next stage"),
                     generate=run("off"), note=note),
            ds.Stage(spec, plain, ds.GENERATION, generate=run("ngram"))]
