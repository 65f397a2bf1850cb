"""Single-stream decode with the weights on huge pages or not, llama.cpp's own tool beside twinfer.

    python bench/bench_hugepages.py --llama-bin /path/to/llama.cpp/build/bin [--rounds 4] [--serve] > out.json

Each round runs, in a rotating order: `llama-bench -p 0 -n 128` as it comes (the GGUF mapped, `-lm mmap`),
read into anonymous memory (`-lm none`), read into anonymous memory that glibc asks huge pages for
(`GLIBC_TUNABLES=glibc.malloc.hugetlb=1`, the tuned peer), and `twinfer bench -c 1` at its defaults
(the weights on huge pages where the kernel gives them: backends/llamacpp/hugepages.py). Prints JSON:
each round's tok/s, the medians, and twinfer's median per-round ratio to each `llama-bench` variant.
`--serve` does the same for bench_peers.py's HTTP pair: `llama-server -np 16` as it comes and read onto
huge pages (`-lm none` under the same glibc tunable), beside `twinfer serve` at its defaults.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from bench_peers import llama_bench_cmd, llama_server, serve_tok_s, twinfer_serve, twinfer_single  # noqa: E402

from twinfer.runtime.cpu import thp_mode  # noqa: E402
from twinfer.runtime.loaders import default_model_path  # noqa: E402


def tg128(bin_dir: Path, model: Path, load_mode: str, env: dict[str, str] | None = None) -> float:
    cmd = llama_bench_cmd(bin_dir, model) + ["-lm", load_mode]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env={**os.environ, **(env or {})}).stdout
    return float(json.loads(out)[0]["avg_ts"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-bin", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--serve", action="store_true", help="the HTTP pair instead of the single stream")
    args = ap.parse_args()
    model = default_model_path()
    hugetlb = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    sides = {
        "llama_server_mmap": lambda: serve_tok_s(llama_server(args.llama_bin, model)),
        "llama_server_none_hugetlb": lambda: serve_tok_s(llama_server(args.llama_bin, model, ("-lm", "none"), hugetlb)),
        "twinfer_serve": lambda: serve_tok_s(twinfer_serve()),
    } if args.serve else {
        "llama_bench_mmap": lambda: tg128(args.llama_bin, model, "mmap"),
        "llama_bench_none": lambda: tg128(args.llama_bin, model, "none"),
        "llama_bench_none_hugetlb": lambda: tg128(args.llama_bin, model, "none", hugetlb),
        "twinfer_bench_c1_decode": lambda: twinfer_single()["twinfer_bench_c1_decode_tok_s"],
    }
    names, rounds = list(sides), []
    for r in range(args.rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        row = {"order": order, **{name: sides[name]() for name in order}}
        print(json.dumps(row), file=sys.stderr)
        rounds.append(row)
    medians = {name: statistics.median(row[name] for row in rounds) for name in names}
    ours = names[-1]
    ratios = {f"{ours}_vs_{name}": statistics.median(row[ours] / row[name] for row in rounds) for name in names[:-1]}
    print(json.dumps({"hardware": {"machine": platform.machine(), "cpus": os.cpu_count(), "thp": thp_mode()},
                      "model": model.name, "rounds": rounds, "medians": medians, "ratios": ratios}, indent=1))


if __name__ == "__main__":
    main()
