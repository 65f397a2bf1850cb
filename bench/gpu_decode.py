"""Decode tokens/s of a random-weight ~8B Llama at batch 1 and 64, BF16 and FP8, with achieved HBM bandwidth.

Weights are drawn on the device (no host copy of 16 GB). The KV cache is left as zeros and decode
starts at position --context, so each step reads every weight once plus batch * context positions
of KV: bytes per step / seconds per step is the achieved bandwidth, printed as a fraction of the
card's peak (4.8 TB/s on an H200). `--dry-run` runs a tiny model on CPU (what CI checks).

    python bench/gpu_decode.py                   # on a GPU
    python bench/gpu_decode.py --dry-run --json  # anywhere
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

from twinfer.backends.cuda.formats import convert_weight, native_weight_format
from twinfer.backends.cuda.graphs import TorchRunner
from twinfer.backends.cuda.ops import TorchOps
from twinfer.runtime.batch import SeqChunk, StepBatch
from twinfer.runtime.runner import KVLayout
from twinfer.runtime.spec import ModelSpec

LLAMA_8B = ModelSpec("llama", vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                     head_dim=128, intermediate_size=14336, rope_theta=500000.0, name="random llama-8b")
TINY = ModelSpec("llama", vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                 intermediate_size=128, name="random tiny llama")
PEAK_TBPS = {"H200": 4.8, "H100": 3.35, "B200": 8.0, "GB200": 8.0, "A100": 2.0}  # HBM, dense spec sheets
BLOCK = 16


def random_runner(spec: ModelSpec, fmt: str, device: torch.device, kv_tokens: int, kernels: str = "auto",
                  graphs: bool = True) -> tuple[TorchRunner, int]:
    """A runner with N(0, 1/fan_in) weights drawn on `device`; also returns the bytes of weights a step reads."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    kind = native_weight_format(fmt if device.type == "cuda" or fmt == "fp8" else None, device)
    kv = KVLayout(block_size=BLOCK, num_blocks=-(-kv_tokens // BLOCK))
    ops = TorchOps(spec, num_blocks=kv.num_blocks + 1, block_size=BLOCK, device=device, dtype=dtype,
                   kernels=kernels)  # + 1: the scratch block of padded CUDA-graph rows
    s, C = spec, spec.hidden_size
    shapes = {"embed": (s.vocab_size, C), "norm": (C,), "lm_head": (s.vocab_size, C)}
    for i in range(s.num_layers):
        p = f"layers.{i}."
        shapes |= {p + "attn_norm": (C,), p + "mlp_norm": (C,), p + "q": (s.q_size, C), p + "k": (s.kv_size, C),
                   p + "v": (s.kv_size, C), p + "o": (C, s.q_size), p + "gate": (s.intermediate_size, C),
                   p + "up": (s.intermediate_size, C), p + "down": (C, s.intermediate_size)}  # fmt: skip
    g = torch.Generator(device=device).manual_seed(0)
    weights: dict[str, Any] = {}
    read = 0
    for name, shape in shapes.items():
        w = (torch.ones(shape, device=device, dtype=dtype) if len(shape) == 1 else
             torch.randn(shape, generator=g, device=device, dtype=dtype) * shape[-1] ** -0.5)
        weights[name] = convert_weight(name, w, kind)
        if name != "embed":  # a step reads only B rows of the embedding
            read += w.numel() * (1 if kind == "fp8" and len(shape) == 2 else w.element_size())
    return TorchRunner(spec, ops, weights, kv, cuda_graphs=graphs), read


def measure(spec: ModelSpec, fmt: str, batch: int, context: int, steps: int, device: torch.device,
            kernels: str = "auto", graphs: bool = True) -> dict[str, Any]:
    per_seq = -(-(context + steps + 8) // BLOCK)  # blocks per sequence: context, warm-up and timed steps
    runner, weight_bytes = random_runner(spec, fmt, device, batch * per_seq * BLOCK, kernels, graphs)
    tables = [list(range(b * per_seq, (b + 1) * per_seq)) for b in range(batch)]

    def step(pos: int) -> None:
        runner.step(StepBatch([SeqChunk(b, [b % spec.vocab_size], pos, tables[b]) for b in range(batch)]))

    for i in range(3):  # warm-up: allocator, kernels, autotuning
        step(context + i)
    t0 = time.perf_counter()
    for i in range(steps):
        step(context + 3 + i)  # to_host at the end of each step waits for the device
    dt = (time.perf_counter() - t0) / steps
    kv_elem = 2 if device.type == "cuda" else 4
    kv_bytes = batch * (context + 3 + steps / 2) * spec.kv_bytes_per_token(kv_elem)
    return {"format": fmt, "batch": batch, "context": context, "kernels": runner.torch_ops.kernels,
            "cuda_graphs": runner.graphs_off is None and bool(runner.graphs), "step_ms": dt * 1e3,
            "tokens_per_s": batch / dt,
            "bytes_per_step": weight_bytes + kv_bytes, "achieved_tbps": (weight_bytes + kv_bytes) / dt / 1e12}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny model on CPU, two timed steps")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--formats", default="bf16,fp8")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--peak-tbps", type=float, default=None, help="the card's HBM bandwidth (default: by name)")
    ap.add_argument("--kernels", default="auto", help="auto (triton on CUDA), triton or torch")
    ap.add_argument("--no-cuda-graphs", action="store_true", help="run every decode step eagerly")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.dry_run or not torch.cuda.is_available():
        if not a.dry_run:
            raise SystemExit("gpu_decode: no CUDA device; use --dry-run to check the script on CPU")
        spec, device, steps, context = TINY, torch.device("cpu"), 2, 32
        card, peak = "cpu (dry run)", a.peak_tbps or 0.1
    else:
        spec, device, steps, context = LLAMA_8B, torch.device("cuda"), a.steps, a.context
        card = torch.cuda.get_device_name()
        peak = a.peak_tbps or next((v for k, v in PEAK_TBPS.items() if k in card.upper()), 0.0)
    params = 2 * spec.vocab_size * spec.hidden_size + spec.num_layers * (
        spec.hidden_size * (2 * spec.q_size + 2 * spec.kv_size) + 3 * spec.hidden_size * spec.intermediate_size)
    rows = []
    for fmt in a.formats.split(","):
        for batch in (int(b) for b in a.batches.split(",")):
            with torch.inference_mode():
                r = measure(spec, fmt, batch, context, steps, device, a.kernels, not a.no_cuda_graphs)
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the last runner's weights and KV are gone: free them for the next
            r["hbm_fraction"] = r["achieved_tbps"] / peak if peak else None
            rows.append(r)
    info = {"card": card, "peak_tbps": peak, "model": spec.name, "params": params, "torch": torch.__version__,
            "rows": rows}
    if a.json:
        print(json.dumps(info))
        return
    print(f"{card}  peak {peak} TB/s  {spec.name} ({params / 1e9:.2f}B params)  torch {torch.__version__}")
    print(f"{'format':>6} {'batch':>5} {'kernels':>7} {'graphs':>6} {'ms/step':>8} {'tok/s':>9} {'TB/s':>6} "
          f"{'of peak':>7}")
    for r in rows:
        frac = f"{r['hbm_fraction']:.0%}" if r["hbm_fraction"] is not None else "-"
        print(f"{r['format']:>6} {r['batch']:>5} {r['kernels']:>7} {'yes' if r['cuda_graphs'] else 'no':>6} "
              f"{r['step_ms']:8.2f} {r['tokens_per_s']:9.1f} {r['achieved_tbps']:6.2f} {frac:>7}")


if __name__ == "__main__":
    main()
