"""How far the top-k + tail-bucket KL estimate (`eval kl --candidate URL`) falls below the exact KL.

Two local llama.cpp runners score the same teacher-forced windows: the default GGUF as the reference
and, as the candidate, the same file again (a faithful server) or its Q2_K requantization (an
unfaithful one). The candidate's logits are truncated to their top k (5, 10, 20) the way an
endpoint's logprobs are, and the estimate is compared with the exact KL on the full vocabulary.
Not a timing benchmark: run it once, anywhere.

    python bench/topk_kl_error.py [--tokens 256] [--window 128]
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from twinfer.app.runners import RUNNERS
from twinfer.quant.fidelity import RunnerSource, corpus_windows
from twinfer.quant.kl import kl_rows
from twinfer.quant.topk_kl import topk_kl_rows, truncate_top_k
from twinfer.runtime.loaders import default_model_path

KS = (5, 10, 20)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--window", type=int, default=128)
    args = ap.parse_args()
    from twinfer.backends.llamacpp.requantize import requantize_gguf

    default = default_model_path()
    q2 = requantize_gguf(default, "q2_k", "MOSTLY_Q2_K")
    ctx = max(256, -(-(args.window + 1) // 256) * 256)
    ref = RunnerSource(RUNNERS.open(None, "llamacpp", max_seqs=2, ctx=ctx))
    rows = []
    for label, cand_path in (("same file", str(default)), ("Q2_K", str(q2))):
        cand = RunnerSource(RUNNERS.open(cand_path, "llamacpp", max_seqs=2, ctx=ctx))
        for corpus in ("prose", "code"):
            exact, est, tail = [], {k: [] for k in KS}, {k: [] for k in KS}
            for w in corpus_windows(None, corpus, args.tokens, args.window):
                if len(w) < 2:
                    continue
                p, q = ref.logits(w)[:-1], cand.logits(w)[:-1]
                exact.append(kl_rows(p, q))
                for k in KS:
                    kl, _, t = topk_kl_rows(p, truncate_top_k(q, k))
                    est[k].append(kl), tail[k].append(t)
            e = float(np.concatenate(exact).mean())
            row = {"candidate": label, "corpus": corpus, "tokens": int(np.concatenate(exact).size), "exact_kl": e}
            for k in KS:
                m = float(np.concatenate(est[k]).mean())
                row[f"top{k}_kl"] = m
                row[f"top{k}_rel_error"] = (m - e) / e if e > 0 else 0.0
                row[f"top{k}_tail_mass"] = float(np.concatenate(tail[k]).mean())
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("| candidate | corpus | tokens | exact KL | " + " | ".join(f"top-{k} (error, tail mass)" for k in KS) + " |")
    print("|---|---|---|---|" + "---|" * len(KS))
    for r in rows:
        cells = [f"{r[f'top{k}_kl']:.4g} ({100 * r[f'top{k}_rel_error']:+.1f}%, {r[f'top{k}_tail_mass']:.3f})" for k in KS]
        print(f"| {r['candidate']} | {r['corpus']} | {r['tokens']} | {r['exact_kl']:.4g} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
