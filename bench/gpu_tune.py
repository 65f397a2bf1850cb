"""Sweep the triton kernels' tiles on this GPU at the decode shapes that matter, then measure decode with the winners.

Three kernels, each timed alone (`triton.testing.do_bench`, median) over a grid of tiles, warps and
stages at the shapes of the benchmarks' models:
- the FP8-weight kernel at one row over every projection of a Llama 8B layer and its output head,
  scored by the time of one decode step's worth of them (32 layers and the head);
- decode attention at batch 1 and 64 over 1,024 positions and batch 1 over 8,192 (8 KV heads of 128),
  scored by their sum;
- the fused MoE at batch 1 and 64 for one EP-8 rank of DeepSeek-V3 (32 of 256 experts of 2048, top 8),
  scored by their sum.
Each kernel's table shows the current default and the best few, with achieved bandwidth. With
`--apply` the winners are set (the modules' CONFIG dicts, this process only) and `gpu_decode.py`'s and
`gpu_moe.py`'s decode steps run with them, so the end-to-end effect is measured in the same run.

    python bench/gpu_tune.py --apply        # on a GPU
    python bench/gpu_tune.py --dry-run      # anywhere: two configs per kernel, tiny shapes, interpreted
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def timer(fn: Any, device: torch.device) -> float:
    """Median ms of fn(): do_bench on a GPU, a few wall-clock runs under the interpreter."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median"))
    import time

    fn()
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def grid(space: dict[str, list[Any]]) -> list[dict[str, Any]]:
    return [dict(zip(space, values, strict=True)) for values in itertools.product(*space.values())]


def sweep(name: str, module: Any, space: dict[str, list[Any]], cases: list[tuple[str, float, int, Any]],
          device: torch.device, top: int) -> dict[str, Any]:
    """Time each config over the cases (label, weight in the score, bytes moved, fn); print and return the best."""
    default = dict(module.CONFIG)
    configs = [default] + [c for c in grid(space) if {**default, **c} != default]
    rows = []
    for cfg in configs:
        module.CONFIG.update(cfg)
        try:
            times = [timer(fn, device) for _, _, _, fn in cases]
        except Exception as e:  # a tile that does not compile here (shared memory): skip it
            print(f"   {name} {cfg}: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
            continue
        finally:
            module.CONFIG.clear()
            module.CONFIG.update(default)
        score = sum(w * t for (_, w, _, _), t in zip(cases, times, strict=True))
        rows.append((score, {**default, **cfg}, times))
    if not rows:
        raise SystemExit(f"gpu_tune: no {name} config ran here (each one's error is above)")
    rows.sort(key=lambda r: r[0])
    base = next(r for r in rows if r[1] == default) if any(r[1] == default for r in rows) else None
    print(f"== {name}: {len(rows)} configs; score = weighted ms; per case ms (TB/s)")
    for label, score, cfg, times in ([("default", *base)] if base else []) + [("best", *r) for r in rows[:top]]:
        cells = "  ".join(f"{c[0]} {t:.3f} ({c[2] / t / 1e9:.2f})" for c, t in zip(cases, times, strict=True))
        print(f"   {label:>7} {score:8.3f}  {json.dumps(cfg)}  {cells}")
    return {"default": base[1] if base else default, "default_score": base[0] if base else None,
            "best": rows[0][1], "best_score": rows[0][0]}


def fp8_cases(device: torch.device, tiny: bool) -> list[tuple[str, float, int, Any]]:
    from twinfer.backends.cuda.formats import Fp8Linear
    from twinfer.backends.cuda.kernels.fp8_gemm import fp8_weight_gemm

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = ([("qo", 2, 64, 64), ("kv", 2, 32, 64)] if tiny else
              [("qo", 64, 4096, 4096), ("kv", 64, 1024, 4096), ("gu", 64, 14336, 4096), ("down", 32, 4096, 14336),
               ("head", 1, 128256, 4096)])  # (label, launches per step, N, K): 32 layers
    out = []
    for label, count, N, K in shapes:
        w = Fp8Linear.from_weight(torch.randn(N, K, device=device, dtype=dtype) * K**-0.5)
        x = torch.randn(1, K, device=device, dtype=dtype)
        out.append((label, float(count), N * K, lambda x=x, w=w: fp8_weight_gemm(x, w.codes, w.scale)))
    return out


def attention_cases(device: torch.device, tiny: bool) -> list[tuple[str, float, int, Any]]:
    from twinfer.backends.cuda.kernels.paged_attention import paged_decode_attention

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    H, Hkv, D, bs = (4, 2, 16, 4) if tiny else (32, 8, 128, 16)
    out = []
    for label, B, ctx in ([("b1", 1, 40), ("b4", 4, 40)] if tiny else [("b1", 1, 1024), ("b64", 64, 1024),
                                                                        ("b1x8k", 1, 8192)]):
        blocks = -(-ctx // bs)
        k, v = (torch.randn(B * blocks * bs, Hkv, D, device=device, dtype=dtype) for _ in range(2))
        tables = torch.arange(B * blocks, device=device, dtype=torch.int32).view(B, blocks)
        lens = torch.full((B,), ctx, device=device, dtype=torch.int32)
        q = torch.randn(B, H, D, device=device, dtype=dtype)
        nbytes = 2 * B * ctx * Hkv * D * k.element_size()
        out.append((label, 1.0, nbytes, lambda q=q, k=k, v=v, t=tables, n=lens:
                    paged_decode_attention(q, k, v, t, n, bs, D**-0.5)))
    return out


def moe_cases(device: torch.device, tiny: bool) -> list[tuple[str, float, int, Any]]:
    from twinfer.backends.cuda.kernels.fused_moe import fused_moe

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    E, local, k, C, inter = (16, 4, 4, 64, 32) if tiny else (256, 32, 8, 7168, 2048)
    gate, up = (torch.randn(local, inter, C, device=device, dtype=dtype) * C**-0.5 for _ in range(2))
    down = torch.randn(local, C, inter, device=device, dtype=dtype) * inter**-0.5
    out = []
    for label, T in (("b1", 1), ("b64", 64 if not tiny else 8)):
        g = torch.Generator(device=device).manual_seed(T)
        ids = torch.stack([torch.randperm(E, generator=g, device=device)[:k] for _ in range(T)])
        w = torch.rand(T, k, generator=g, device=device, dtype=torch.float32).to(dtype)
        x = torch.randn(T, C, device=device, dtype=dtype)
        touched = len(set(ids.flatten().tolist()) & set(range(local)))
        nbytes = touched * 3 * inter * C * gate.element_size()
        out.append((label, 1.0, max(nbytes, 1), lambda x=x, ids=ids, w=w: fused_moe(x, gate, up, down, ids, w)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes, two configs per kernel, interpreted on CPU")
    ap.add_argument("--apply", action="store_true", help="then measure decode with the winners (gpu_decode, gpu_moe)")
    ap.add_argument("--only", default="fp8,attention,moe")
    ap.add_argument("--top", type=int, default=4)
    ap.add_argument("--json", default=None, help="write the winners and scores here")
    a = ap.parse_args()
    if a.dry_run:  # set before the kernel modules are imported: triton reads it when it decorates them
        os.environ["TRITON_INTERPRET"] = "1"
    elif not torch.cuda.is_available():
        raise SystemExit("gpu_tune: no CUDA device; use --dry-run to check the script on CPU")
    device = torch.device("cpu" if a.dry_run else "cuda")
    from twinfer.backends.cuda.kernels import fp8_gemm, fused_moe, paged_attention

    spaces = {
        "fp8": (fp8_gemm, fp8_cases, {"block_n": [16, 32, 64], "block_k": [128, 256], "num_warps": [4, 8],
                                      "num_stages": [3, 4], "programs_per_sm": [2, 4]}),
        "attention": (paged_attention, attention_cases, {"block_n": [16, 32, 64, 128], "num_warps": [2, 4, 8],
                                                         "programs_per_sm": [2, 4]}),
        "moe": (fused_moe, moe_cases, {"block_m": [16, 32, 64], "block_n": [32, 64, 128], "block_k": [32, 64],
                                       "num_warps": [4, 8]}),
    }
    if a.dry_run:  # two configs each: the default and one more
        spaces = {k: (m, c, {key: vals[:2] if key == next(iter(s)) else vals[:1] for key, vals in s.items()})
                  for k, (m, c, s) in spaces.items()}
    results = {}
    with torch.inference_mode():
        for name in a.only.split(","):
            module, cases, space = spaces[name]
            results[name] = sweep(name, module, space, cases(device, a.dry_run), device, a.top)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    if not a.apply:
        return
    for name, r in results.items():
        spaces[name][0].CONFIG.update(r["best"])
    print("== decode with the winners: " + "; ".join(f"{n} {json.dumps(r['best'])}" for n, r in results.items()))
    import gpu_decode
    import gpu_moe

    with torch.inference_mode():
        if a.dry_run:
            rows = [gpu_decode.measure(gpu_decode.TINY, "fp8", 1, 32, 2, device)]
        else:
            rows = [gpu_decode.measure(gpu_decode.LLAMA_8B, f, b, 1024, 32, device) for f in ("bf16", "fp8")
                    for b in (1, 64)]
            torch.cuda.empty_cache()
            spec = gpu_moe.deepseek_v3(4)
            rows += [gpu_moe.measure(spec, "fp8", 8, b, 1024, 16, device, "auto", True) for b in (1, 64)]
    for r in rows:
        print(f"   {r['format']:>5} batch {r['batch']:>3} {'ep ' + str(r['ep']) if 'ep' in r else 'llama':>6}  "
              f"{r['step_ms']:7.2f} ms/step {r['tokens_per_s']:8.1f} tok/s {r['achieved_tbps']:5.2f} TB/s")


if __name__ == "__main__":
    main()
