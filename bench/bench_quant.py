"""Quantization fidelity on the default model: the tables of docs/quantization.md.

    python bench/bench_quant.py [--tokens 1024] [--window 256] [--parts weights,kv,search,interact] > quant.json

Reference: the torch backend in float32 on the GGUF's dequantized weights. Each part prints progress
on stderr and the whole run one JSON object on stdout (with hardware and build):

* weights:  every registry format applied uniformly to the layer projections; mean / p99 KL, same
  top p, on the prose and code corpora (--tokens each, teacher-forced windows of --window);
* kv:       TurboQuant KV (tq2.5, tq3, tq3.5, tq4, QJL keys at 3 and 4) vs the dense fp32 cache on
  torch, and llama.cpp's q8_0 / q4_0 caches vs its f16 cache, on the same tokens;
* search:   the searched assignment vs the uniform format at the same average bits (budgets of
  uniform tq4 and tq3), sensitivities measured on --search-tokens of prose, judged on both corpora;
* interact: quantize blocks one by one (tq2) and report where adding a block lowered the KL.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from twinfer.app.bench import hardware_info
from twinfer.app.runners import RUNNERS
from twinfer.quant.fidelity import RunnerSource, corpus_windows, runner_with_options
from twinfer.quant.kl import KLAccumulator
from twinfer.quant.kv_format import parse_kv_format
from twinfer.quant.model_io import quantizable
from twinfer.quant.registry import FORMATS
from twinfer.quant.search import FormatSearch, KLProbe, groups_of
from twinfer.runtime.loaders import default_model_path, load_model

CORPORA = ("prose", "code")
KV_FORMATS = ("tq2.5", "tq3", "tq3.5", "tq4", "tq4-qjl")
LLAMA_KV = ("q8_0", "q4_0")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def stats(acc: KLAccumulator) -> dict[str, float]:
    r = acc.report("", "", "")
    return {"mean_kl": r.mean_kl, "p99_kl": r.p99_kl, "median_kl": r.median_kl, "max_kl": r.max_kl,
            "same_top_p": r.top1_agreement, "rms_delta_p": r.rms_delta_p or 0.0, "tokens": r.tokens}


def probe_stats(probe: KLProbe, assignment: dict[str, str]) -> dict[str, float]:
    for name, fmt in assignment.items():
        probe.runner.weights[name] = probe.dense(name, fmt)
    try:
        acc = KLAccumulator()
        for ref, w in zip(probe.reference, probe.windows, strict=True):
            acc.add(ref, probe.source.logits(w)[:-1], np.asarray(w[1:]))
    finally:
        probe.runner.weights.update(probe.original)
    return stats(acc)


def part_weights(probes: dict[str, KLProbe], names: list[str]) -> list[dict[str, Any]]:
    rows = []
    for fmt in FORMATS:
        row: dict[str, Any] = {"format": fmt, "bits_per_weight": FORMATS[fmt]}
        for corpus, probe in probes.items():
            row[corpus] = probe_stats(probe, dict.fromkeys(names, fmt))
        next(iter(probes.values())).forget(fmt)
        log(f"weights {fmt}: " + ", ".join(f"{c} {row[c]['mean_kl']:.5f}" for c in probes))
        rows.append(row)
    return rows


def part_kv(windows: dict[str, list[list[int]]], ctx: int, spec_head_dim: int, kv_formats: list[str],
            llama_kv: list[str]) -> list[dict[str, Any]]:
    rows = []
    pairs: list[tuple[str, dict[str, str], str, dict[str, str]]] = [("torch", {}, "torch", {"kv": f}) for f in kv_formats]
    pairs += [("llamacpp", {"kv": "f16"}, "llamacpp", {"kv": k}) for k in llama_kv]
    refs: dict[str, dict[str, list[np.ndarray]]] = {}
    for ref_backend, ref_opts, backend, opts in pairs:
        key = ref_backend
        if key not in refs:
            src = RunnerSource(runner_with_options(ref_backend, ref_opts, None, ctx, RUNNERS))
            refs[key] = {c: [src.logits(w)[:-1] for w in ws] for c, ws in windows.items()}
            _close(src)
        src = RunnerSource(runner_with_options(backend, opts, None, ctx, RUNNERS))
        row: dict[str, Any] = {"reference": f"{ref_backend} {ref_opts.get('kv', 'f32')} KV", "kv": opts["kv"],
                               "backend": backend}
        fmt = parse_kv_format(opts["kv"]) if backend == "torch" else None
        row["bits_per_element"] = fmt.bits_per_element(spec_head_dim) if fmt else {"q8_0": 8.5, "q4_0": 4.5}[opts["kv"]]
        for corpus, ws in windows.items():
            acc = KLAccumulator()
            for ref, w in zip(refs[key][corpus], ws, strict=True):
                acc.add(ref, src.logits(w)[:-1], np.asarray(w[1:]))
            row[corpus] = stats(acc)
        _close(src)
        log(f"kv {backend} {opts['kv']}: " + ", ".join(f"{c} {row[c]['mean_kl']:.5f}" for c in windows))
        rows.append(row)
    return rows


def _close(src: RunnerSource) -> None:
    close = getattr(src.runner, "close", None)
    if close:
        close()


def part_search(probes: dict[str, KLProbe], search_probe: KLProbe, formats: list[str],
                budgets: list[tuple[str, float]], granularity: str, reuse: str | None = None) -> dict[str, Any]:
    search = FormatSearch(search_probe, formats, granularity, log=log)
    if reuse:  # the sensitivities of an earlier run with the same formats, groups and search tokens
        saved = json.loads(Path(reuse).read_text())["search"]["sensitivities"]
        search.sens = {g: {f: saved[g][f] for f in search.formats} for g in search.groups}
        log(f"sensitivities reused from {reuse}")
    else:
        search.measure_sensitivities()
    names = quantizable(search_probe.weights)
    out: dict[str, Any] = {"formats": search.formats, "granularity": granularity, "sensitivities": search.sens,
                           "budgets": []}
    for label, budget in budgets:
        result = search.search(budget)
        row: dict[str, Any] = {"uniform": label, "budget": budget, "searched_bits": result.bits,
                               "predicted_kl": result.predicted_kl, "history": result.history,
                               "assignment_counts": _counts(result.assignment)}
        for corpus, probe in probes.items():
            row[corpus] = {"uniform": probe_stats(probe, dict.fromkeys(names, label)),
                           "searched": probe_stats(probe, result.assignment)}
        log(f"search @ {budget:.3f}: " + ", ".join(
            f"{c} uniform {row[c]['uniform']['mean_kl']:.5f} searched {row[c]['searched']['mean_kl']:.5f}"
            for c in probes))
        out["budgets"].append(row)
    out["evaluations"] = search_probe.evaluations
    return out


def part_interact(probe: KLProbe, fmt: str, granularity: str) -> dict[str, Any]:
    groups = groups_of(quantizable(probe.weights), granularity)
    assignment: dict[str, str] = {}
    steps = []
    for g, ns in groups.items():
        assignment.update(dict.fromkeys(ns, fmt))
        steps.append({"added": g, "groups": len(steps) + 1, "mean_kl": probe.measure(assignment).mean})
    drops = [s for prev, s in zip(steps, steps[1:], strict=False) if s["mean_kl"] < prev["mean_kl"]]
    log(f"interact: {len(drops)} of {len(steps) - 1} additions lowered KL")
    return {"format": fmt, "steps": steps, "lowered": [d["added"] for d in drops]}


def _counts(assignment: dict[str, str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for f in assignment.values():
        out[f] = out.get(f, 0) + 1
    return out


def markdown(r: dict[str, Any]) -> str:
    """The docs/quantization.md tables from a result object."""
    out: list[str] = []

    def kl(c: dict[str, float]) -> str:
        return f"{c['mean_kl']:.5f} | {c['p99_kl']:.4f} | {100 * c['same_top_p']:.1f}"

    if "weights" in r:
        out += ["| format | bits/weight | prose mean KL | prose p99 | prose same top p % | code mean KL | code p99 "
                "| code same top p % |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for row in r["weights"]:
            out.append(f"| {row['format']} | {row['bits_per_weight']:.3f} | {kl(row['prose'])} | {kl(row['code'])} |")
        out.append("")
    if "kv" in r:
        out += ["| KV cache | reference | bits/element | prose mean KL | prose p99 | prose same top p % | code mean KL "
                "| code p99 | code same top p % |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
        for row in r["kv"]:
            out.append(f"| {row['backend']} {row['kv']} | {row['reference']} | {row['bits_per_element']:.3f} | "
                       f"{kl(row['prose'])} | {kl(row['code'])} |")
        out.append("")
    if "search" in r:
        out += ["| budget (bits/weight) | assignment | bits | prose mean KL | prose p99 | code mean KL | code p99 |",
                "|---|---|---:|---:|---:|---:|---:|"]
        for row in r["search"]["budgets"]:
            for kind in ("uniform", "searched"):
                label = row["uniform"] if kind == "uniform" else "searched: " + ", ".join(
                    f"{f} x{n}" for f, n in sorted(row["assignment_counts"].items()))
                bits = row["budget"] if kind == "uniform" else row["searched_bits"]
                p, c = row["prose"][kind], row["code"][kind]
                out.append(f"| {row['budget']:.3f} | {label} | {bits:.3f} | {p['mean_kl']:.5f} | {p['p99_kl']:.4f} | "
                           f"{c['mean_kl']:.5f} | {c['p99_kl']:.4f} |")
        out.append("")
    if "interact" in r:
        steps = r["interact"]["steps"]
        out.append("| blocks quantized | last added | mean KL |")
        out.append("|---:|---|---:|")
        out += [f"| {s['groups']} | {s['added']} | {s['mean_kl']:.5f} |" for s in steps]
        out.append("")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--markdown", metavar="JSON", help="Print the docs tables of a saved result and exit.")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--search-tokens", type=int, default=128)
    ap.add_argument("--parts", default="weights,kv,search,interact")
    ap.add_argument("--search-formats", default="tq2,tq3,tq4,int8")
    ap.add_argument("--judge-tokens", type=int, default=512, help="Tokens per corpus the search is judged on.")
    ap.add_argument("--out", help="Also write the (partial) result here after each part.")
    ap.add_argument("--budgets", default="tq4,tq3", help="Uniform formats whose bit costs are the search budgets.")
    ap.add_argument("--reuse-sensitivities", metavar="JSON", help="A saved search result whose sensitivities to reuse.")
    ap.add_argument("--granularity", default="block", help="Search and interaction groups: block, layer, tensor.")
    ap.add_argument("--kv-formats", default=",".join(KV_FORMATS))
    ap.add_argument("--llama-kv", default=",".join(LLAMA_KV))
    args = ap.parse_args()
    if args.markdown:
        with open(args.markdown, encoding="utf-8") as f:
            print(markdown(json.load(f)))
        return
    parts = set(args.parts.split(","))
    loaded = load_model(None)
    names = quantizable(loaded.weights)
    windows = {c: list(corpus_windows(None, c, args.tokens, args.window)) for c in CORPORA}
    result: dict[str, Any] = {"model": str(default_model_path()), "hardware": hardware_info(),
                              "tokens_per_corpus": args.tokens, "window": args.window,
                              "reference": "torch backend, float32, dequantized GGUF weights"}
    probes: dict[str, KLProbe] = {}
    first = None
    if parts & {"weights"}:
        first = KLProbe(loaded.spec, loaded.weights, windows[CORPORA[0]], runners=RUNNERS)
        probes = {CORPORA[0]: first}
        probes.update({c: KLProbe(loaded.spec, loaded.weights, windows[c], share=first) for c in CORPORA[1:]})
        log("reference logits ready")
    def save() -> None:
        if args.out:
            with open(args.out, "w", encoding="utf-8") as f:
                json.dump(result, f, indent=1)

    if "weights" in parts:
        result["weights"] = part_weights(probes, names)
        save()
    if "kv" in parts:
        result["kv"] = part_kv(windows, -(-(args.window + 1) // 256) * 256, loaded.spec.head_dim,
                               [f for f in args.kv_formats.split(",") if f], [k for k in args.llama_kv.split(",") if k])
        save()
    if parts & {"search", "interact"}:
        probes = first = None  # type: ignore[assignment]  # free the 1,024-token references
        judge_windows = {c: list(corpus_windows(None, c, args.judge_tokens, args.window)) for c in CORPORA}
        lead = KLProbe(loaded.spec, loaded.weights, judge_windows[CORPORA[0]], runners=RUNNERS)  # owns the runner (longest KV)
        judges = {CORPORA[0]: lead}
        judges.update({c: KLProbe(loaded.spec, loaded.weights, judge_windows[c], share=lead) for c in CORPORA[1:]})
        sw = list(corpus_windows(None, "prose", args.search_tokens, min(args.window, args.search_tokens)))
        search_probe = KLProbe(loaded.spec, loaded.weights, sw, share=lead)
        if "search" in parts:
            budgets = [(f, FORMATS[f]) for f in args.budgets.split(",")]
            result["search"] = part_search(judges, search_probe, args.search_formats.split(","), budgets,
                                           args.granularity, args.reuse_sensitivities)
            result["search"]["judge_tokens_per_corpus"] = args.judge_tokens
            save()
        if "interact" in parts:
            result["interact"] = part_interact(search_probe, "tq2", args.granularity)
            save()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
