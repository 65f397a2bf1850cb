"""`twinfer quantize`: choose a weight format per tensor at a bit budget, write a quantized folder
recording its measured KL (`--search`: measured sensitivities; `--gguf`: also DIR/model.gguf;
`--verify` re-checks a folder)."""

from __future__ import annotations

import json
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import typer

from twinfer.runtime.errors import TwinferError

DEFAULT_FORMATS = "tq2,tq2.5,tq3,tq3.5,tq4,int4,int8"
VERIFY_TOKENS = 64
REGRESSION = 1.25  # --verify warns when the re-measured KL exceeds the recorded one by this factor


@dataclass(frozen=True)
class QuantizeOptions:
    """How `twinfer quantize` picks and writes formats (its flags, checked once here)."""

    budget: float | None = None  # average bits per weight over the layer projections
    formats: tuple[str, ...] = tuple(DEFAULT_FORMATS.split(","))  # candidate weight formats
    search: bool = False  # measure per-group sensitivities and search combinations (else: one uniform format)
    tokens: int = 256  # corpus tokens the KL is measured on
    corpus: str = "prose"
    granularity: str = "block"  # search groups: block, layer or tensor
    group_size: int | None = None  # affine group; None: 64, or 32 with --gguf and no search (Q4_1's block)
    gguf: bool = False  # also write DIR/model.gguf
    gguf_int8: bool = False  # with gguf: requantize int8 tensors to Q8_0

    def __post_init__(self) -> None:
        from twinfer.quant.linear import check_format
        from twinfer.quant.model_io import DEFAULT_GROUP

        try:
            for f in self.formats:
                check_format(f)
        except ValueError as e:
            raise TwinferError(f"--formats: {e}", field="formats") from e
        if self.tokens < 16:
            raise TwinferError("--tokens must be at least 16", field="tokens")
        if self.search and self.group_size not in (None, DEFAULT_GROUP):
            raise TwinferError(f"--search measures the affine formats at group {DEFAULT_GROUP}; "
                               "drop --group-size or --search", field="group_size")
        if self.group not in (32, 64, 128):
            raise TwinferError(f"--group-size must be 32, 64 or 128, got {self.group}", field="group_size")

    @property
    def group(self) -> int:
        from twinfer.quant.model_io import DEFAULT_GROUP

        return self.group_size or (32 if self.gguf and not self.search else DEFAULT_GROUP)


def run_quantize(model: str | None, out: str | None, options: QuantizeOptions, verify: bool = False,
                 json_out: bool = False) -> None:
    if verify:
        if model is None:
            raise TwinferError("--verify needs the quantized folder as MODEL", field="verify")
        report = verify_folder(Path(model))
        typer.echo(json.dumps(report) if json_out else _verify_line(report))
        return
    if options.gguf and out is None and options.budget is None and model is not None:
        exported = export_folder(Path(model), options.gguf_int8)
        typer.echo(json.dumps(exported) if json_out else _gguf_line(exported))
        return
    if out is None or options.budget is None:
        raise TwinferError("twinfer quantize needs --out DIR and --budget BITS_PER_WEIGHT "
                           "(or a quantized folder as MODEL with --verify or --gguf)")
    summary = quantize(model, Path(out), options, log=lambda m: print(m, file=sys.stderr))
    typer.echo(json.dumps(summary) if json_out else _summary_lines(summary))


def quantize(model: str | None, out: Path, options: QuantizeOptions, log: Any = None) -> dict[str, Any]:
    """Pick the assignment, write `out`, measure the written folder; returns the recorded summary.

    `options.gguf`: also write `out`/model.gguf (the affine group then defaults to Q4_1's 32, as the GGUF
    stores a scale and bias per 32 weights either way)."""
    from twinfer.app.runners import RUNNERS
    from twinfer.quant.fidelity import corpus_windows
    from twinfer.quant.model_io import (
        QuantizedView,
        average_bits,
        quantizable,
        update_config,
        write_quantized,
    )
    from twinfer.quant.search import FormatSearch, KLProbe
    from twinfer.runtime.loaders import load_model
    from twinfer.runtime.model_path import resolve_path

    o = options
    if o.budget is None:
        raise TwinferError("twinfer quantize needs --budget BITS_PER_WEIGHT", field="budget")
    budget, formats, search, group, gguf_int8 = o.budget, list(o.formats), o.search, o.group, o.gguf_int8
    tokens, corpus, granularity, gguf = o.tokens, o.corpus, o.granularity, o.gguf
    source = resolve_path(model)
    loaded = load_model(source)
    if loaded.format == "quantized":
        raise TwinferError(f"{source} is already quantized; quantize its source model instead")
    if gguf:
        _check_gguf_export(source, formats, gguf_int8)
    names = quantizable(loaded.weights)
    if not names:
        raise TwinferError(f"{source} has no layer projections twinfer can quantize")
    windows = list(corpus_windows(model, corpus, tokens, min(256, tokens)))
    probe = KLProbe(loaded.spec, loaded.weights, windows, runners=RUNNERS)
    if search:
        try:
            result = FormatSearch(probe, formats, granularity, log=log).search(budget)
        except ValueError as e:
            raise TwinferError(str(e)) from e
        assignment, history = result.assignment, result.history
    else:
        assignment, history = dict.fromkeys(names, _uniform(formats, budget, group)), []
    try:
        view = QuantizedView(loaded.weights, assignment, group_size=group)
    except ValueError as e:
        raise TwinferError(f"--group-size {group}: {e}") from e
    write_quantized(out, loaded.spec, view, source.resolve(), {"budget": budget, "search": search})
    kl = _measure_folder(out, source, windows)
    short = {**_measure_folder(out, source, [windows[0][:VERIFY_TOKENS]]), "window": windows[0][:VERIFY_TOKENS]}
    summary = {
        "out": str(out), "source": str(source), "bits_per_weight": average_bits(loaded.weights, assignment, group),
        "formats": _counts(assignment), "kl": kl, "verify": short,
        "history": [list(h) for h in history],
    }
    update_config(out, kl=kl, verify=short, history=summary["history"])
    if gguf:
        summary["gguf"] = export_folder(out, gguf_int8)
    return summary


def _uniform(formats: list[str], budget: float, group: int) -> str:
    """The costliest format in `formats` that fits `budget` bits per weight."""
    from twinfer.quant.model_io import format_bits

    bits = {f: format_bits(f, group) for f in formats}
    fitting = [f for f in formats if bits[f] <= budget + 1e-9]
    if not fitting:
        cheapest = min(formats, key=lambda f: bits[f])
        at = f" at group size {group}" if cheapest in ("int4", "int8") else ""
        raise TwinferError(f"budget {budget} is below every format in --formats (cheapest: {cheapest}, "
                           f"{bits[cheapest]:.3f} bits per weight{at})")
    return max(fitting, key=lambda f: bits[f])


def _check_gguf_export(source: Path, formats: list[str], gguf_int8: bool) -> None:
    """Refuse --gguf before any work when the source or a candidate format cannot export."""
    from twinfer.quant.gguf_export import check_source, formats_that_export, unexportable

    check_source(source)
    bad = unexportable(formats, gguf_int8)
    if bad:
        raise TwinferError(f"--gguf: {', '.join(bad)} in --formats have no GGUF type that holds them without "
                           f"requantizing; formats that export: {formats_that_export()}")


def export_folder(folder: Path, gguf_int8: bool) -> dict[str, Any]:
    """Write FOLDER/model.gguf; returns what was written (JSON-able)."""
    from twinfer.quant.gguf_export import GGUF_FILE, export_gguf

    r = export_gguf(folder, folder / GGUF_FILE, int8_as_q8_0=gguf_int8)
    return {"path": str(r.path), "bytes": r.nbytes, "types": r.types, "kept": r.kept,
            "max_abs_change": r.max_abs_change, "file_type": r.file_type}


def _measure_folder(folder: Path, source: Path, windows: list[list[int]]) -> dict[str, Any]:
    """KL(source fp32 || folder as loaded, both on torch) on `windows`."""
    from twinfer.app.runners import RUNNERS
    from twinfer.quant.fidelity import RunnerSource
    from twinfer.quant.kl import KLAccumulator
    from twinfer.runtime.loaders import load_model

    ctx = max(64, -(-max(len(w) for w in windows) // 16) * 16)
    src, quantized = load_model(source), load_model(folder)
    ref = RunnerSource(RUNNERS.build("torch", src.spec, src.weights, kv_tokens=ctx))
    cand = RunnerSource(RUNNERS.build("torch", quantized.spec, quantized.weights, kv_tokens=ctx))
    acc = KLAccumulator()
    for w in windows:
        acc.add(ref.logits(w)[:-1], cand.logits(w)[:-1], np.asarray(w[1:]))
    r = acc.report(str(source), str(folder), "")
    return {"mean_kl": r.mean_kl, "p99_kl": r.p99_kl, "same_top_p": r.top1_agreement, "tokens": r.tokens}


def verify_folder(folder: Path) -> dict[str, Any]:
    """Re-measure the recorded verification window; warn when KL regressed past REGRESSION x recorded."""
    from twinfer.runtime.loaders.quantized import is_quantized_folder

    if not is_quantized_folder(folder):
        raise TwinferError(f"{folder} is not a twinfer quantized folder (no quantization_config in config.json)")
    qc = json.loads((folder / "config.json").read_text(encoding="utf-8"))["quantization_config"]
    recorded = qc.get("verify")
    source = Path(qc.get("source", ""))
    if not recorded or "window" not in recorded or not source.exists():
        raise TwinferError(f"{folder} records no verification window or its source {source} is gone; "
                           "re-run twinfer quantize")
    now = _measure_folder(folder, source, [[int(t) for t in recorded["window"]]])
    regressed = now["mean_kl"] > recorded["mean_kl"] * REGRESSION + 1e-6
    if regressed:
        warnings.warn(f"{folder}: KL regressed from {recorded['mean_kl']:.5f} to {now['mean_kl']:.5f} "
                      "on the verification window", stacklevel=2)
    return {"folder": str(folder), "recorded_kl": recorded["mean_kl"], "measured_kl": now["mean_kl"],
            "regressed": regressed}


def _counts(assignment: dict[str, str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for f in assignment.values():
        out[f] = out.get(f, 0) + 1
    return dict(sorted(out.items()))


def _summary_lines(s: dict[str, Any]) -> str:
    kl = s["kl"]
    return "\n".join([
        f"wrote {s['out']}: {s['bits_per_weight']:.3f} bits per weight over the layer projections",
        "  formats " + ", ".join(f"{f} x{n}" for f, n in s["formats"].items()),
        f"  KL vs {s['source']}: mean {kl['mean_kl']:.6f}, p99 {kl['p99_kl']:.6f}, "
        f"same top p {100 * kl['same_top_p']:.2f} % on {kl['tokens']} tokens",
        *(["  " + _gguf_line(s["gguf"])] if "gguf" in s else []),
    ])


def _gguf_line(g: dict[str, Any]) -> str:
    types = ", ".join(f"{t} x{n}" for t, n in g["types"].items())
    change = ", ".join(f"{f} {c:.2g}" for f, c in g["max_abs_change"].items())
    return (f"GGUF {g['path']}: {g['bytes'] / 1e6:.1f} MB, {types} ({g['kept']} tensors as stored), "
            f"{g['file_type']}; largest weight change {change}")


def _verify_line(r: dict[str, Any]) -> str:
    state = "REGRESSED" if r["regressed"] else "ok"
    return f"{r['folder']}: verification KL {r['measured_kl']:.6f} (recorded {r['recorded_kl']:.6f}) {state}"
