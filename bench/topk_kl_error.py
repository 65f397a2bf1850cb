"""How far the top-k KL estimates of `eval kl --candidate URL` fall from the exact KL.

Two local llama.cpp runners score the same teacher-forced windows: the default GGUF as the reference
and, as the candidate, the same file again (a faithful server), its Q8_0 requantization (a mild one)
or its Q4_0 and Q2_K requantizations (unfaithful ones). The candidate's logits are truncated to their
top k (5, 10, 20) the way an endpoint's logprobs are, and both estimates (the tail bucket, a lower
bound, and the censored tail model `eval kl` reports) are compared with the exact KL on the full
vocabulary. Not a timing benchmark: run it once, anywhere.

    python bench/topk_kl_error.py [--tokens 256] [--window 128]
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from twinfer.app.models import open_model
from twinfer.quant.fidelity import RunnerSource, corpus_windows
from twinfer.quant.kl import kl_rows
from twinfer.quant.topk_kl import topk_estimate_rows, truncate_top_k
from twinfer.runtime.loaders import default_model_path

KS = (5, 10, 20)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--window", type=int, default=128)
    args = ap.parse_args()
    from twinfer.backends.llamacpp.requantize import requantize_gguf

    default = default_model_path()
    candidates = {"same file": default, "Q8_0": requantize_gguf(default, "q8_0", "MOSTLY_Q8_0"),
                  "Q4_0": requantize_gguf(default, "q4_0", "MOSTLY_Q4_0"),
                  "Q2_K": requantize_gguf(default, "q2_k", "MOSTLY_Q2_K")}
    ctx = max(256, -(-(args.window + 1) // 256) * 256)
    ref = RunnerSource(open_model(None, "llamacpp", max_seqs=2, ctx=ctx, threads=1).runner)
    rows = []
    for label, cand_path in candidates.items():
        cand = RunnerSource(open_model(str(cand_path), "llamacpp", max_seqs=2, ctx=ctx, threads=1).runner)
        for corpus in ("prose", "code"):
            rows.append(score(ref, cand, label, corpus, args.tokens, args.window))
            print(json.dumps(rows[-1]), flush=True)
    print("| candidate | corpus | tokens | exact KL | estimate | " + " | ".join(f"top-{k}" for k in KS) + " |")
    print("|---|---|---|---|---|" + "---|" * len(KS))
    for r in rows:
        for name in ("bucket", "tail_model"):
            cells = [f"{r[f'top{k}_{name}']:.4g} ({100 * r[f'top{k}_{name}_rel_error']:+.0f}%)" for k in KS]
            label = "bucket (lower bound)" if name == "bucket" else "tail model"
            print(f"| {r['candidate']} | {r['corpus']} | {r['tokens']} | {r['exact_kl']:.4g} | {label} | "
                  + " | ".join(cells) + " |")


def score(ref: RunnerSource, cand: RunnerSource, label: str, corpus: str, tokens: int, window: int) -> dict:
    """Exact KL and both top-k estimates (mean, relative error) of one candidate on one corpus."""
    exact, est = [], {(k, name): [] for k in KS for name in ("bucket", "tail_model", "tail_mass")}
    for w in corpus_windows(None, corpus, tokens, window):
        if len(w) < 2:
            continue
        p, q = ref.logits(w)[:-1], cand.logits(w)[:-1]
        exact.append(kl_rows(p, q))
        for k in KS:
            scored = topk_estimate_rows(p, truncate_top_k(q, k))
            est[k, "bucket"].append(scored.bucket)
            est[k, "tail_model"].append(scored.estimate)
            est[k, "tail_mass"].append(scored.tail)
    e = float(np.concatenate(exact).mean())
    row: dict = {"candidate": label, "corpus": corpus, "tokens": int(np.concatenate(exact).size), "exact_kl": e}
    for (k, name), parts in est.items():
        m = float(np.concatenate(parts).mean())
        row[f"top{k}_{name}"] = m
        if name != "tail_mass":
            row[f"top{k}_{name}_rel_error"] = (m - e) / e if e > 0 else 0.0
    return row


if __name__ == "__main__":
    main()
