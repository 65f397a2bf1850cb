"""The KL a lossy `--memory-budget` choice costs against the stored file at F16 KV, on a fixed text,
measured once in a child process and cached as JSON beside the file it made (docs/architecture.md)."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from twinfer.runtime.cache_dir import cache_dir
from twinfer.runtime.errors import PlanError

KL_CORPUS, KL_TOKENS, KL_WINDOW = "prose", 256, 128


@dataclass(frozen=True)
class MeasuredKL:
    """KL(stored file || budget's choice) in nats on `tokens` scored tokens of `corpus`."""

    mean: float
    p99: float
    top1: float  # share of positions where both rank the same token first
    tokens: int
    corpus: str

    def line(self, expected: float | None) -> str:
        guess = f"; the planner expected about {expected:.4f}" if expected is not None else ""
        return (f"Measured KL against the stored file: {self.mean:.4f} nats mean (p99 {self.p99:.4f}, same top "
                f"token {100 * self.top1:.1f}%) on {self.tokens} tokens of {self.corpus}{guess}.")


def measured_kl(reference: Path, candidate: Path, kv_type: str | None, bound: int | None,
                threads: int | None = None) -> MeasuredKL:
    """KL of `candidate` run at `kv_type` against `reference` (its stored source at F16 KV): cached, else
    measured in a child process with the reference's experts paged under `bound` bytes."""
    kv = kv_type or "f16"
    sidecar = _sidecar(candidate, kv)
    key = _identity(reference, candidate, kv)
    if sidecar.is_file():
        cached = json.loads(sidecar.read_text())
        if cached.get("key") == key:
            return MeasuredKL(**cached["kl"])
    args = [str(reference), str(candidate), kv, str(bound or 0), str(threads or 0)]
    result = subprocess.run([sys.executable, "-m", "twinfer.app.budget_kl", *args], stdout=subprocess.PIPE,
                            text=True, check=False)
    if result.returncode != 0 or not result.stdout.strip():
        raise PlanError(f"could not measure the KL of {candidate.name} against {reference.name} "
                        f"(exit code {result.returncode})")
    kl = MeasuredKL(**json.loads(result.stdout.strip().splitlines()[-1]))
    sidecar.parent.mkdir(parents=True, exist_ok=True)
    sidecar.write_text(json.dumps({"key": key, "kl": asdict(kl)}, indent=1))
    return kl


def _sidecar(candidate: Path, kv: str) -> Path:
    """Beside a file the budget made (in twinfer's cache); for the stored file itself, in cache_dir."""
    name = f"{candidate.stem}.kl-kv-{kv}.json"
    cache = cache_dir("").resolve()
    made = cache in candidate.resolve().parents
    return candidate.with_name(name) if made else cache_dir("budget-kl") / name


def _identity(reference: Path, candidate: Path, kv: str) -> dict[str, Any]:
    ref, cand = reference.stat(), candidate.stat()
    return {"reference": [str(reference.resolve()), ref.st_size, ref.st_mtime_ns],
            "candidate": [cand.st_size, cand.st_mtime_ns], "kv": kv,
            "text": [KL_CORPUS, KL_TOKENS, KL_WINDOW]}


def measure(reference: Path, candidate: Path, kv: str, bound: int, threads: int) -> MeasuredKL:
    """The measurement itself (in this process): reference logits to disk, one window at a time, then the
    candidate's against them."""
    import numpy as np

    from twinfer.app.runners import RUNNERS
    from twinfer.quant.fidelity import RunnerSource, corpus_windows
    from twinfer.quant.kl import KLAccumulator

    windows = list(corpus_windows(str(reference), KL_CORPUS, KL_TOKENS, KL_WINDOW))
    ctx = -(-(KL_WINDOW + 1) // 256) * 256
    common: dict[str, Any] = {"max_seqs": 1, "ctx": ctx, "threads": threads or None}
    acc = KLAccumulator()
    with tempfile.TemporaryDirectory() as tmp:  # a large vocabulary's logits would not fit the budget
        ref = RUNNERS.open(str(reference), "llamacpp", expert_cache_bytes=bound or None, **common)
        try:
            for i, w in enumerate(windows):
                np.save(Path(tmp) / f"{i}.npy", RunnerSource(ref).logits(w)[:-1])
        finally:
            getattr(ref, "close", lambda: None)()
        cand = RUNNERS.open(str(candidate), "llamacpp", kv_type=kv, **common)
        source = RunnerSource(cand)
        try:
            for i, w in enumerate(windows):
                acc.add(np.load(Path(tmp) / f"{i}.npy"), source.logits(w)[:-1], np.asarray(w[1:]))
        finally:
            getattr(cand, "close", lambda: None)()
    r = acc.report(reference.name, candidate.name, KL_CORPUS)
    return MeasuredKL(r.mean_kl, r.p99_kl, r.top1_agreement, r.tokens, f"the {KL_CORPUS} corpus")


if __name__ == "__main__":  # measured_kl's child: prints the measurement as one JSON line
    _ref, _cand, _kv, _bound, _threads = sys.argv[1:6]
    print(json.dumps(asdict(measure(Path(_ref), Path(_cand), _kv, int(_bound), int(_threads)))))
