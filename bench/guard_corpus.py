"""The loop guard over text that must never trip it, and over loops that must.

    python bench/guard_corpus.py [--tokenizer PATH]... [--stdlib-files N] [--worst K] [--json OUT]

Real text, tokenized as a model would emit it and fed to the guard one token at a time as a
generation's output: the Python standard library's sources, the language reference's prose
(`pydoc_data.topics`), the Markdown long descriptions of the installed packages (`*.dist-info/METADATA`),
and generated numbers, tables (CSV of zeros, Markdown and ASCII tables, hex dumps, base64, C arrays)
and JSON documents (long numbers, indentation, repeated records). A document trips if the guard
cuts it anywhere. Degenerate loops (one token, a word, a phrase of 2-8 tokens, a sentence, a blank
flood, a digit flood) follow a real prefix; each reports how many tokens into the loop it was cut.
`--worst K` lists the K longest verbatim repeats of each kind in the real text (what the thresholds
must stay above). Tokenizers: the default model's (Gemma 3, which splits numbers into digits) and
each `--tokenizer` (a GGUF file, vocabulary-only ones included, or a Hugging Face folder).
"""

from __future__ import annotations

import argparse
import base64
import json
import random
import sys
import sysconfig
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from twinfer.runtime.engine.guard import LoopGuard, token_text, unit_kind
from twinfer.runtime.engine.params import GuardConfig
from twinfer.runtime.tokenizer import Tokenizer, load_tokenizer

Doc = tuple[str, str]  # (name, text)


# -- real text ---------------------------------------------------------------------------------------
def stdlib_files(limit: int = 0) -> list[Path]:
    """The standard library's .py files, sorted; `limit` > 0 takes that many at an even stride."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    if 0 < limit < len(files):
        files = [files[i * len(files) // limit] for i in range(limit)]
    return files


def stdlib_docs(limit: int = 0) -> list[Doc]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return [(str(p.relative_to(root)), p.read_text(encoding="utf-8", errors="replace")) for p in stdlib_files(limit)]


def prose_docs() -> list[Doc]:
    import pydoc_data.topics

    return sorted(pydoc_data.topics.topics.items())


def markdown_docs() -> list[Doc]:
    """The Markdown long descriptions of the installed packages (their PyPI pages)."""
    site = Path(sysconfig.get_paths()["purelib"])
    out = []
    for meta in sorted(site.glob("*.dist-info/METADATA")):
        text = meta.read_text(encoding="utf-8", errors="replace")
        if "text/markdown" in text.split("\n\n", 1)[0]:
            out.append((meta.parent.name, text.split("\n\n", 1)[-1]))
    return out


# -- generated numbers, tables and JSON ---------------------------------------------------------------
def number_docs() -> list[Doc]:
    lines = {
        "repeat": ["Repeat exactly: 1000000", "1000000 and 2000000", "The answer is 100000000000000000000."],
        "powers of ten": [f"10^{k} = {10**k} = {10**k:,}" for k in range(121)],
        "powers of two": [f"2^{k} = {2**k}" for k in range(0, 1025, 8)],
        "repdigits": [d * k for d in "0123456789" for k in (8, 16, 40, 80)],
        "small decimals": [f"{10.0**-k:.{k}f}" for k in range(1, 60)] + ["0." + "0" * 29 + "1"],
        "repeating decimals": [f"1/{q} = 0.{str(10**200 // q).zfill(200)}" for q in (3, 7, 11, 13, 27, 37, 81, 99)],
        "binary": [f"{x:#066b}" for x in (0, 1, 2, 255, 2**32, 2**63)] + [f"{x:032b}" for x in range(0, 64, 3)],
        "ids": ["00000000-0000-0000-0000-000000000000", "::1", "0000:0000:0000:0000:0000:0000:0000:0001",
                "00:00:00:00:00:00", "ff:ff:ff:ff:ff:ff", "0x" + "0" * 64, "0x" + "f" * 64,
                "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"],
        "money": [f"${v:,.2f}" for v in (1e3, 1e6, 1e9, 1e12, 1.5e15, 1000000.01)],
    }
    return [(f"numbers/{k}", "\n".join(v) + "\n") for k, v in lines.items()]


def table_docs() -> list[Doc]:
    rng = random.Random(0)
    csv_zeros = "\n".join(",".join(["0"] * 16) for _ in range(40))
    header = "| " + " | ".join(f"col{i}" for i in range(8)) + " |\n| " + " | ".join(["---"] * 8) + " |\n"
    md_zeros = header + "".join("| " + " | ".join(["0"] * 8) + " |\n" for _ in range(30))
    md_nums = header + "".join("| " + " | ".join(str(rng.choice([0, 0, 1, 100, 1000000])) for _ in range(8))
                               + " |\n" for _ in range(30))
    rule = "+" + "+".join(["-" * 12] * 6) + "+\n"
    ascii_box = rule + "".join("|" + "|".join(f" {0:<10} " for _ in range(6)) + "|\n" + rule for _ in range(15))
    data = bytes(512) + rng.randbytes(256) + bytes(1024) + b"\xff" * 256
    xxd = "".join(f"{i:08x}: " + " ".join(data[i + j : i + j + 2].hex() for j in range(0, 16, 2)) + "  "
                  + "".join(chr(b) if 32 <= b < 127 else "." for b in data[i : i + 16]) + "\n"
                  for i in range(0, len(data), 16))
    spaced = "\n".join(data[i : i + 16].hex(" ") for i in range(0, len(data), 16))
    docs = {
        "csv zeros": csv_zeros, "markdown zeros": md_zeros, "markdown numbers": md_nums, "ascii box": ascii_box,
        "xxd": xxd, "hex bytes": spaced, "hex run": bytes(768).hex(),
        "base64 random": base64.b64encode(rng.randbytes(3000)).decode(),
        "base64 zeros": base64.b64encode(bytes(1024)).decode(),
        "base64 pixels": "data:image/x-raw;base64," + base64.b64encode(b"\xff\x00\x00" * 400).decode(),
        "base64 lines": base64.encodebytes(bytes(600) + rng.randbytes(600)).decode(),
        "c array": "static const uint8_t buf[256] = {" + ", ".join(["0x00"] * 256) + "};\n",
        "numpy zeros": "[" + "\n ".join("[" + " ".join(["0."] * 12) + "]" for _ in range(12)) + "]\n",
        "latex matrix": "\\begin{pmatrix}\n" + "".join(" & ".join(["0"] * 10) + " \\\\\n" for _ in range(10))
                        + "\\end{pmatrix}\n",
        "rules": "\n".join(c * 79 for c in "=-#*~_") + "\n" + "─" * 120 + "\n" + "═" * 120 + "\n",
        "indentation": "".join(" " * (4 * d) + "{\n" for d in range(24)) + "".join(" " * (4 * d) + "}\n"
                                                                                  for d in range(23, -1, -1)),
    }
    return [(f"tables/{k}", v) for k, v in docs.items()]


def json_docs() -> list[Doc]:
    rng = random.Random(1)
    cities = [{"name": n, "population": p, "area_km2": a, "founded": f, "coordinates": {"lat": 48.8566, "lon": 2.3522}}
              for n, p, a, f in [("Springfield", 111111, 100.0, 1800), ("Paris", 2100000, 105.4, -250),
                                 ("Tokyo", 14000000, 2194.07, 1457), ("Nowhere", 0, 0.0, 0)]]
    nested: Any = {"value": 1000000}
    for depth in range(12):
        nested = {f"level{depth}": nested, "zeros": [0] * 8, "id": 10**depth}
    docs = {
        "city": json.dumps(cities[0]),
        "cities indent 2": json.dumps(cities, indent=2),
        "nested indent 4": json.dumps(nested, indent=4),
        "big numbers": json.dumps({"big": [10**k for k in range(0, 60, 3)], "neg": -(10**30), "tiny": 1e-300,
                                   "ones": int("1" * 50), "float": 1000000.000001}, indent=2),
        "zeros": json.dumps({"matrix": [[0] * 16 for _ in range(16)], "flags": [False] * 32}),
        "points": json.dumps([{"x": 0, "y": 0}] * 12),
        "records": json.dumps([{"id": i, "score": rng.choice([0, 100, 1000000]), "tags": []} for i in range(60)],
                              indent=2),
    }
    return [(f"json/{k}", v) for k, v in docs.items()]


# -- loops ----------------------------------------------------------------------------------------------
LOOP_UNITS = {
    "one token": [" yes", " the", "ok", " Paris", "你好"],
    "word": [" hello", " banana", " indeed", " loop"],
    "phrase 2-8 tokens": [" the cat", " I think so", " and then we went", " it is what it is,",
                          " over and over again and", " `foo` is not defined."],
    "sentence": [" The quick brown fox jumps over the lazy dog.", "\nI am sorry, but I cannot help with that.",
                 " Let me check the file again to see what is wrong.\n",
                 "def f(x):\n    return f(x)\n", "我不知道。"],
    "blank flood": ["\n", " ", "\n\n", "\t"],
    "filler flood": ["0", "!", "-", ".", "00", "。"],
}


@dataclass
class Result:
    tokenizer: str
    corpus: dict[str, dict[str, Any]] = field(default_factory=dict)
    loops: dict[str, dict[str, Any]] = field(default_factory=dict)
    worst: dict[str, Any] = field(default_factory=dict)


def encode(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False, parse_special=False)


def first_trip(guard: LoopGuard, ids: list[int], cfg: GuardConfig, start: int = 1) -> int | None:
    """The output length at which the guard first cuts `ids` fed one token at a time, or None."""
    return next((n for n in range(max(start, 1), len(ids) + 1) if guard.find(ids, cfg, n) is not None), None)


def run_corpus(guard: LoopGuard, tok: Tokenizer, docs: list[Doc], cfg: GuardConfig) -> dict[str, Any]:
    """Every document as a generation's output, the guard asked after each token: which ones it cuts,
    and its CPU time per token."""
    tripped, tokens, seconds = [], 0, 0.0
    for name, text in docs:
        ids = encode(tok, text)
        tokens += len(ids)
        started = time.process_time()
        n = first_trip(guard, ids, cfg)
        seconds += time.process_time() - started
        if n is not None:
            loop = guard.find(ids, cfg, n)
            tripped.append({"doc": name, "at": n, "loop": asdict(loop) if loop else None,
                            "text": tok.decode(ids[max(0, n - 40) : n])})
    return {"docs": len(docs), "tokens": tokens, "tripped": len(tripped), "rate": len(tripped) / max(len(docs), 1),
            "trips": tripped[:20], "guard_us_per_token": round(seconds / max(tokens, 1) * 1e6, 2)}


def run_loops(guard: LoopGuard, tok: Tokenizer, prefixes: list[str], cfg: GuardConfig) -> dict[str, Any]:
    """Each loop unit repeated after each prefix for twice the longest limit: caught or not, and how far
    in (tokens from the loop's first one to the cut)."""
    budget = 2 * max(cfg.filler_chars, cfg.blank_chars, cfg.text_chars)
    out: dict[str, Any] = {}
    for kind, units in LOOP_UNITS.items():
        caught, into = 0, []
        for prefix in prefixes:
            head = encode(tok, prefix)
            for unit in units:
                ids = encode(tok, unit)
                body = ids * (budget // len(ids) + 1)
                n = first_trip(guard, head + body[:budget], cfg, start=len(head) + 1)
                if n is not None:
                    caught += 1
                    into.append(n - len(head))
        total = len(prefixes) * len(units)
        out[kind] = {"loops": total, "caught": caught, "rate": caught / total,
                     "tokens_into_loop": {"min": min(into, default=None), "median": _median(into),
                                          "max": max(into, default=None)}}
    return out


def _median(xs: list[int]) -> float | None:
    return float(np.median(xs)) if xs else None


MIN_SPAN, MIN_CHARS = 8, 64  # shorter repeats are everywhere (a double space, "((") and far from any threshold


def worst_repeats(guard: LoopGuard, tok: Tokenizer, docs: list[Doc], cfg: GuardConfig, k: int) -> dict[str, Any]:
    """The longest verbatim repeats (a unit of <= max_period tokens, 2+ copies back to back) in `docs`:
    for text, the one with most copies, and the longest in characters and in tokens; for blank and
    filler, the k longest in characters. The thresholds must stay above these."""
    max_period, min_copies = cfg.max_period, cfg.min_copies
    found: dict[str, list[dict[str, Any]]] = {"text": [], "blank": [], "filler": []}
    for name, text in docs:
        ids = np.asarray(encode(tok, text), dtype=np.int64)
        if len(ids) < 2:
            continue
        chars = np.concatenate([[0], np.cumsum([len(guard.text(int(t))) for t in ids])])
        seen: set[int] = set()  # run ends already reported by a smaller period
        for p in range(1, min(max_period, len(ids) // 2) + 1):
            for start, end in _runs(ids[p:] == ids[:-p], p, chars):  # [start, end) repeats with period p
                if end in seen:
                    continue
                seen.add(end)
                unit = "".join(guard.text(int(t)) for t in ids[start : start + p])
                found[unit_kind(unit)].append({"doc": name, "period": p, "tokens": end - start,
                                               "copies": (end - start) // p, "chars": int(chars[end] - chars[start]),
                                               "unit": unit[:48]})
    runs, looped = found["text"], [r for r in found["text"] if r["copies"] >= min_copies]
    text = {"most copies": max(runs, key=lambda r: r["copies"], default=None),
            f"most characters, {min_copies}+ copies": max(looped, key=lambda r: r["chars"], default=None),
            f"most tokens, {min_copies}+ copies": max(looped, key=lambda r: r["tokens"], default=None),
            "most tokens, 2+ copies": max(runs, key=lambda r: r["tokens"], default=None)}
    return {"text": text, **{kind: sorted(found[kind], key=lambda r: -r["chars"])[:k] for kind in ("blank", "filler")}}


def _runs(eq: np.ndarray, p: int, chars: np.ndarray) -> Iterator[tuple[int, int]]:
    """Spans [start, end) that repeat with period p over 2+ copies (eq[i]: ids[i + p] == ids[i]) and
    cover MIN_SPAN tokens or MIN_CHARS characters."""
    edges = np.flatnonzero(np.diff(np.concatenate([[False], eq, [False]]).astype(np.int8)))
    starts, ends = edges[::2], edges[1::2] + p  # ids[start : end] has period p
    keep = (ends - starts >= 2 * p) & ((ends - starts >= MIN_SPAN) | (chars[ends] - chars[starts] >= MIN_CHARS))
    yield from zip(starts[keep].tolist(), ends[keep].tolist(), strict=True)


def loop_prefixes() -> list[str]:
    return ["The capital of France is", "def main():\n    ", "Sure! Here is the answer:\n\n", "| a | b |\n|---|---|\n"]


CORPORA: dict[str, Callable[[argparse.Namespace], list[Doc]]] = {
    "stdlib": lambda a: stdlib_docs(a.stdlib_files),
    "prose": lambda a: prose_docs(),
    "markdown": lambda a: markdown_docs(),
    "numbers": lambda a: number_docs(),
    "tables": lambda a: table_docs(),
    "json": lambda a: json_docs(),
}


def run(args: argparse.Namespace) -> list[Result]:
    cfg = GuardConfig()
    docs = {name: make(args) for name, make in CORPORA.items()}
    results = []
    for path in [None, *args.tokenizer]:
        tok = load_tokenizer(path)
        guard = LoopGuard(token_text(tok))
        res = Result(Path(path).name if path else "default (Gemma 3 270M)")
        for name, corpus in docs.items():
            res.corpus[name] = run_corpus(guard, tok, corpus, cfg)
            c = res.corpus[name]
            print(f"{res.tokenizer} {name}: {c['tripped']}/{len(corpus)} tripped ({c['tokens']} tokens, "
                  f"{c['guard_us_per_token']} us/token)", file=sys.stderr)
        res.loops = run_loops(guard, tok, loop_prefixes(), cfg)
        if args.worst:
            real = [d for name, corpus in docs.items() for d in corpus]
            res.worst = worst_repeats(guard, tok, real, cfg, args.worst)
        results.append(res)
    return results


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", action="append", default=[], help="another tokenizer (GGUF or HF folder)")
    ap.add_argument("--stdlib-files", type=int, default=0, help="stdlib files to read (0: all)")
    ap.add_argument("--worst", type=int, default=0, help="list the K longest verbatim repeats of each kind")
    ap.add_argument("--json", type=Path, help="write the results here too")
    return ap.parse_args(argv)


def main() -> None:
    args = parse()
    results = [asdict(r) for r in run(args)]
    text = json.dumps({"config": asdict(GuardConfig()), "results": results}, indent=1)
    if args.json:
        args.json.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
