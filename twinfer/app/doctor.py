"""`twinfer doctor MODEL [PROMPT]`: run the same tokens through every stage that applies and find the
first one that changes the model more than it may; the result carries hardware, versions and revision."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from twinfer.app import doctor_stages as ds
from twinfer.runtime.errors import TwinferError
from twinfer.runtime.model_path import resolve_path

SPEC_TOKENS = 24  # greedy tokens the speculative stage generates


@dataclass(frozen=True)
class StageResult:
    stage: str
    base: str | None
    allowance: str
    max_kl: float | None
    mean_kl: float | None = None
    worst_kl: float | None = None
    top1_agreement: float | None = None
    greedy_identical: bool | None = None
    passed: bool | None = None  # None: skipped or the reference
    skipped: str = ""
    seconds: float = 0.0
    note: str = ""


@dataclass
class DoctorReport:
    model: str
    tokens: int
    stages: list[StageResult]
    context: dict[str, Any] = field(default_factory=dict)

    @property
    def first_divergence(self) -> StageResult | None:
        return next((s for s in self.stages if s.passed is False), None)

    def as_dict(self) -> dict[str, Any]:
        first = self.first_divergence
        return {"model": self.model, "tokens": self.tokens, "stages": [asdict(s) for s in self.stages],
                "first_divergence": first.stage if first else None, "context": self.context}

    def lines(self) -> list[str]:
        out = [f"twinfer doctor: {self.model}, {self.tokens} tokens", "",
               f"{'stage':<34} {'against':<22} {'mean KL':>10} {'max KL':>10} {'top-1':>7} {'greedy':>7}  verdict"]
        for s in self.stages:
            if s.skipped:
                out.append(f"{s.stage:<34} {'':<22} {'':>10} {'':>10} {'':>7} {'':>7}  skipped: {s.skipped}")
                continue
            kl = f"{s.mean_kl:10.2e} {s.worst_kl:10.2e}" if s.mean_kl is not None and s.worst_kl is not None \
                else f"{'-':>10} {'-':>10}"
            top1 = f"{100 * s.top1_agreement:6.1f}%" if s.top1_agreement is not None else f"{'-':>7}"
            greedy = {True: "same", False: "DIFF", None: "-"}[s.greedy_identical]
            verdict = "reference" if s.passed is None else ("ok" if s.passed else "DIVERGES")
            out.append(f"{s.stage:<34} {s.base or '':<22} {kl} {top1} {greedy:>7}  {verdict} ({s.allowance})")
        first = self.first_divergence
        out += ["", f"first divergence: {first.stage} (against {first.base}; allowed {first.allowance})" if first
                else "every stage is within its allowance"]
        c = self.context
        out.append(f"hardware: {c.get('hardware')}; twinfer {c.get('twinfer_revision')}; "
                   + ", ".join(f"{k} {v}" for k, v in c.get("libraries", {}).items()))
        if "llamacpp_amx" in c:
            out.append(f"llama.cpp AMX: {c['llamacpp_amx']}")
        return out


def run_doctor(model: str | None, prompt: str | None = None, *, tokens: int = 64, memory_budget: str | None = None,
               skip: tuple[str, ...] = (), extra_stages: tuple[ds.Stage, ...] = ()) -> DoctorReport:
    """Every stage that applies to `model`, in order; `extra_stages` (tests) run after the built-in ones."""
    from twinfer.runtime.loaders import load_model
    from twinfer.runtime.tokenizer import load_tokenizer

    path = resolve_path(model)
    ids = _tokens(load_tokenizer(path), prompt, tokens)
    spec = load_model(path).spec
    stages = [*build_stages(path, spec, len(ids), memory_budget), *extra_stages]
    results: list[StageResult] = []
    outputs: dict[str, Any] = {}
    for stage in stages:
        if stage.name in skip:
            results.append(_skipped(stage, "--skip"))
            continue
        results.append(_run(stage, ids, outputs))
    return DoctorReport(str(path), len(ids), results, environment())


def _tokens(tokenizer: Any, prompt: str | None, tokens: int) -> list[int]:
    from twinfer.runtime.corpus import corpus_text

    if tokens < 2:
        raise TwinferError(f"--tokens must be at least 2, got {tokens}")
    text = prompt if prompt else corpus_text("prose", max_chars=tokens * 12 + 2000)
    ids = tokenizer.encode(text)[:tokens]
    if len(ids) < 2:
        raise TwinferError("the prompt is shorter than two tokens; give a longer PROMPT")
    return list(ids)


def _skipped(stage: ds.Stage, why: str) -> StageResult:
    return StageResult(stage.name, stage.base, stage.allowance.why, stage.allowance.max_kl, skipped=why)


def _run(stage: ds.Stage, ids: list[int], outputs: dict[str, Any]) -> StageResult:
    if stage.note.startswith("skip:"):
        return _skipped(stage, stage.note.removeprefix("skip:").strip())
    if stage.base is not None and stage.base not in outputs:
        return _skipped(stage, f"its base stage {stage.base} did not run")
    start = time.perf_counter()
    try:
        out: Any = stage.logits(ids) if stage.logits else stage.generate(ids) if stage.generate else None
    except TwinferError as exc:
        return _skipped(stage, str(exc))
    seconds = time.perf_counter() - start
    outputs[stage.name] = out
    a = stage.allowance
    base = StageResult(stage.name, stage.base, a.why, a.max_kl, seconds=seconds, note=stage.note)
    if stage.base is None:
        return base
    ref = outputs[stage.base]
    if stage.generate is not None or isinstance(ref, list):
        same = list(out) == list(ref)
        return StageResult(**{**asdict(base), "greedy_identical": same, "passed": same or not a.greedy})
    return _compare(base, ref, out, a)


def _compare(result: StageResult, ref: np.ndarray, out: np.ndarray, a: ds.Allowance) -> StageResult:
    from twinfer.quant.kl import kl_rows

    ref, out = ref[:-1], out[:-1]  # the last row predicts past the tokens
    kl = kl_rows(ref, out)
    agree = np.argmax(ref, axis=-1) == np.argmax(out, axis=-1)
    same = bool(agree.all())
    ok = (a.max_kl is None or float(kl.mean()) <= a.max_kl) and (same or not a.greedy)
    return StageResult(**{**asdict(result), "mean_kl": float(kl.mean()), "worst_kl": float(kl.max()),
                          "top1_agreement": float(agree.mean()), "greedy_identical": same, "passed": ok})


def build_stages(path: Any, spec: Any, n_tokens: int, memory_budget: str | None) -> list[ds.Stage]:
    """The stages that apply to this model, each with its base; stages that cannot run here say why."""
    import twinfer.app.doctor_build as b

    ctx = max(256, -(-(n_tokens * 2 + SPEC_TOKENS) // 256) * 256)
    fault = ds.fault_request()
    stages = [b.reference(path)]
    graphs = [g for g in ("torch", "mlx") if ds.available(g) is None]
    prev = "reference"
    for g in ("torch", "mlx"):
        stages.append(b.graph(path, g, ctx, prev, fault))
        if g in graphs:
            prev = g
    gguf = path.is_file()
    if gguf:
        stages.append(b.llamacpp(path, ctx, prev))
    first_graph = graphs[0] if graphs else None
    runner_stage = "llama.cpp" if gguf else first_graph
    if memory_budget:
        stages.append(b.budget(path, memory_budget, ctx, runner_stage or "reference"))
    if first_graph:
        stages += b.parallel(path, spec, ctx, first_graph)
        stages.append(b.batched(path, first_graph, ctx, fault))
    stages += b.speculative(path, "llamacpp" if gguf else (first_graph or "torch"), ctx)
    return stages


def environment() -> dict[str, Any]:
    """Hardware, backend library versions and twinfer's git revision, recorded with every result."""
    import importlib.metadata as md
    import platform
    import subprocess
    from pathlib import Path

    libs = {}
    for dist in ("torch", "mlx", "llama_cpp_python", "transformers", "numpy"):
        try:
            libs[dist] = md.version(dist)
        except md.PackageNotFoundError:
            continue
    try:
        from twinfer.planners.probe import read_host

        h = read_host()
        hardware = f"{h.model or h.machine} ({h.vendor}), {h.cores} cores, {h.memory_bytes / 1e9:.0f} GB"
    except Exception as exc:  # noqa: BLE001 - the record is still useful without the host's description
        hardware = f"{platform.machine()} (not described: {exc})"
    root = Path(__file__).resolve().parents[2]
    try:
        rev = subprocess.run(["git", "-C", str(root), "describe", "--always", "--dirty"], capture_output=True,
                             text=True, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        rev = "unknown"
    context = {"hardware": hardware, "platform": platform.platform(), "python": platform.python_version(),
               "libraries": libs, "twinfer_revision": rev}
    if "llama_cpp_python" in libs:
        context["llamacpp_amx"] = llamacpp_amx()
    return context


AMX_STATES = {
    "none": "none (this CPU has no AMX)",
    "on": "on (its AMX kernels run here)",
    "off": "off (its AMX kernels crash on this CPU: twinfer keeps them out of every process that loads llama.cpp)",
}


def llamacpp_amx() -> str:
    """Whether llama.cpp's AMX kernels run here, as the llama.cpp runner decides it (a cached verdict, or
    a one-off probe in a child process), without changing this process."""
    from twinfer.backends.llamacpp.amx import amx_verdict, cpu_has_amx

    try:
        return AMX_STATES["none" if not cpu_has_amx() else amx_verdict()]
    except Exception as exc:  # noqa: BLE001 - the record is still useful without it
        return f"unknown ({exc})"
