"""Decode tokens/s of a DeepSeek-V3-shaped random MoE (a few layers at full width, FP8, EP) at batch 1 and 64,
with achieved HBM bandwidth.

The model is DeepSeek-V3's layer at full width (hidden 7168, 128 heads of MLA with a 512 + 64 latent,
256 routed experts of 2048, top 8 in 8 groups keeping 4, one shared expert, sigmoid routing with a
score bias), `--layers` of them (default 4) instead of 61, and the real 129,280-token vocabulary.
Weights are drawn on the device. FP8 holds every 2-D projection (q_a, q_b, kv_a, o, shared expert,
lm_head) as E4M3 with a scale per row; the routed experts stay BF16 (the grouped MoE kernel takes BF16).

Expert parallelism: with `--ep N` this GPU is one rank of N. It holds 256 / N experts of every layer
(rank 0's: ids 0 .. 256/N - 1), routes every token over all 256, and computes only the pairs routed to
its experts (`TorchOps.experts` with an `ExpertStack` whose `first` is the slice's start, the path the EP runner takes after its all-to-all). The
all-to-all itself is not in the number: on one GPU there is no peer. The bytes a step reads are the
dense weights, the KV latents, and the experts this rank's tokens touch: top_k / N of them per token
at batch 1, and E/N * (1 - (1 - k/E)^B) distinct ones at batch B (uniform routing, which random
router weights give), each read once.

    python bench/gpu_moe.py                        # on a GPU: EP 8, batches 1 and 64
    python bench/gpu_moe.py --dry-run --json       # anywhere: a tiny width on CPU
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

from twinfer.backends.cuda.formats import Fp8Linear, native_weight_format
from twinfer.backends.cuda.graphs import TorchRunner
from twinfer.backends.cuda.ops import ExpertStack, TorchOps
from twinfer.runtime.batch import SeqChunk, StepBatch
from twinfer.runtime.models import model_for
from twinfer.runtime.ops import ExpertExtras
from twinfer.runtime.runner import KVLayout
from twinfer.runtime.spec import SIGMOID, MLASpec, ModelSpec, MoESpec

PEAK_TBPS = {"H200": 4.8, "H100": 3.35, "B200": 8.0, "GB200": 8.0, "A100": 2.0}  # HBM, dense spec sheets
BLOCK = 16


def deepseek_v3(layers: int, tiny: bool = False) -> ModelSpec:
    """DeepSeek-V3's shape with `layers` MoE layers; `tiny` shrinks every width (the CPU dry run)."""
    if tiny:
        mla = MLASpec(kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
        moe = MoESpec(num_experts=16, top_k=4, expert_intermediate_size=32, num_shared_experts=1,
                      shared_intermediate_size=32, router_softmax_before_topk=False, scoring=SIGMOID, n_group=4,
                      topk_group=2, routed_scaling_factor=2.5, score_bias=True)
        return ModelSpec("deepseek_v3", vocab_size=256, hidden_size=64, num_layers=layers, num_heads=4,
                         num_kv_heads=4, head_dim=24, intermediate_size=96, mla=mla, moe=moe,
                         softmax_scale=24**-0.5, name="random tiny deepseek-v3 shape")
    mla = MLASpec(kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)
    moe = MoESpec(num_experts=256, top_k=8, expert_intermediate_size=2048, num_shared_experts=1,
                  shared_intermediate_size=2048, router_softmax_before_topk=False, scoring=SIGMOID, n_group=8,
                  topk_group=4, routed_scaling_factor=2.5, score_bias=True)
    return ModelSpec("deepseek_v3", vocab_size=129280, hidden_size=7168, num_layers=layers, num_heads=128,
                     num_kv_heads=128, head_dim=192, intermediate_size=18432, mla=mla, moe=moe,
                     softmax_scale=192**-0.5, name=f"random deepseek-v3 shape, {layers} layers")


class EPRankOps(TorchOps):
    """One expert-parallel rank's Ops: routing over every expert, compute over the ones held here."""

    def __init__(self, spec: ModelSpec, *, first: int, **kwargs: Any):
        super().__init__(spec, **kwargs)
        self.first = first

    def moe(self, x: torch.Tensor, router: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
            moe: MoESpec, act: str, extras: ExpertExtras | None = None) -> torch.Tensor:
        weights, experts = self.route(x, router, moe, extras)
        return self.experts(x, weights, experts, ExpertStack(gate, up, down, self.first), act, moe=moe, extras=extras)


FP8_LEAVES = ("q_a", "q_b", "kv_a", "o", "gate", "up", "down", "lm_head")  # the 2-D projections


def random_runner(spec: ModelSpec, fmt: str, ep: int, device: torch.device, kv_tokens: int, kernels: str,
                  graphs: bool) -> tuple[TorchRunner, dict[str, int]]:
    """A rank of `ep` with N(0, 1/fan_in) weights drawn on `device`; also the bytes of its weights by kind."""
    assert spec.moe is not None and spec.moe.num_experts % ep == 0
    local = spec.moe.num_experts // ep
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    kind = native_weight_format(fmt, device) if fmt == "fp8" else "as-dtype"
    kv = KVLayout(block_size=BLOCK, num_blocks=-(-kv_tokens // BLOCK))
    ops = EPRankOps(spec, first=0, num_blocks=kv.num_blocks + 1, block_size=BLOCK, device=device, dtype=dtype,
                    kernels=kernels)  # + 1: the scratch block of padded CUDA-graph rows
    g = torch.Generator(device=device).manual_seed(0)
    weights: dict[str, Any] = {}
    sizes = {"dense": 0, "experts": 0}
    for name, shape in model_for(spec).weight_shapes().items():
        if ".experts." in name:
            shape = (local, *shape[1:])  # this rank's experts
        if "norm" in name:
            w = torch.ones(shape, device=device, dtype=dtype)
        elif name.endswith(("score_bias", "_bias")):
            w = torch.zeros(shape, device=device, dtype=dtype)
        else:
            w = torch.randn(shape, generator=g, device=device, dtype=dtype) * shape[-1] ** -0.5
        leaf = name.rsplit(".", 1)[-1]
        if kind == "fp8" and w.dim() == 2 and leaf in FP8_LEAVES and ".experts." not in name:
            weights[name] = Fp8Linear.from_weight(w)
            nbytes = w.numel() + 4 * shape[0]  # E4M3 codes and a float32 scale per row
            del w
        else:
            weights[name] = w
            nbytes = w.numel() * w.element_size()
        if name != "embed":  # a step reads only B rows of the embedding
            sizes["experts" if ".experts." in name else "dense"] += nbytes
    return TorchRunner(spec, ops, weights, kv, cuda_graphs=graphs), sizes


def touched_experts(num_experts: int, top_k: int, batch: int, ep: int) -> float:
    """Distinct experts of one rank's share a batch of uniformly routed tokens reaches, per layer."""
    return num_experts / ep * (1.0 - (1.0 - top_k / num_experts) ** batch)


def measure(spec: ModelSpec, fmt: str, ep: int, batch: int, context: int, steps: int, device: torch.device,
            kernels: str, graphs: bool) -> dict[str, Any]:
    assert spec.moe is not None
    per_seq = -(-(context + steps + 8) // BLOCK)
    runner, sizes = random_runner(spec, fmt, ep, device, batch * per_seq * BLOCK, kernels, graphs)
    tables = [list(range(b * per_seq, (b + 1) * per_seq)) for b in range(batch)]

    def step(pos: int) -> None:
        runner.step(StepBatch([SeqChunk(b, [(7 * b + 1) % spec.vocab_size], pos, tables[b]) for b in range(batch)]))

    for i in range(3):  # warm-up: allocator, kernels, autotuning
        step(context + i)
    t0 = time.perf_counter()
    for i in range(steps):
        step(context + 3 + i)  # to_host at the end of each step waits for the device
    dt = (time.perf_counter() - t0) / steps
    local = spec.moe.num_experts // ep
    expert_read = sizes["experts"] / local * touched_experts(spec.moe.num_experts, spec.moe.top_k, batch, ep)
    kv_elem = 2 if device.type == "cuda" else 4
    kv_bytes = batch * (context + 3 + steps / 2) * spec.kv_bytes_per_token(kv_elem)
    read = sizes["dense"] + expert_read + kv_bytes
    return {"format": fmt, "ep": ep, "batch": batch, "context": context, "kernels": runner.torch_ops.kernels,
            "cuda_graphs": runner.graphs_off is None and bool(runner.graphs), "step_ms": dt * 1e3,
            "tokens_per_s": batch / dt, "dense_bytes": sizes["dense"], "expert_bytes_read": expert_read,
            "kv_bytes": kv_bytes, "bytes_per_step": read, "achieved_tbps": read / dt / 1e12}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny width on CPU, two timed steps (what CI runs)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--ep", type=int, default=8, help="expert-parallel ranks this GPU is one of (1: every expert)")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--formats", default="fp8")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--peak-tbps", type=float, default=None, help="the card's HBM bandwidth (default: by name)")
    ap.add_argument("--kernels", default="auto", help="auto (triton on CUDA), triton or torch")
    ap.add_argument("--no-cuda-graphs", action="store_true", help="run every decode step eagerly")
    ap.add_argument("--json", action="store_true")
    return ap.parse_args(argv)


def run(a: argparse.Namespace) -> dict[str, Any]:
    if a.dry_run:
        spec, device, steps, context = deepseek_v3(a.layers, tiny=True), torch.device("cpu"), 2, 32
        card, peak = "cpu (dry run)", a.peak_tbps or 0.1
    elif not torch.cuda.is_available():
        raise SystemExit("gpu_moe: no CUDA device; use --dry-run to check the script on CPU")
    else:
        spec, device, steps, context = deepseek_v3(a.layers), torch.device("cuda"), a.steps, a.context
        card = torch.cuda.get_device_name()
        peak = a.peak_tbps or next((v for k, v in PEAK_TBPS.items() if k in card.upper()), 0.0)
    rows = []
    for fmt in a.formats.split(","):
        for batch in (int(b) for b in a.batches.split(",")):
            with torch.inference_mode():
                r = measure(spec, fmt, a.ep, batch, context, steps, device, a.kernels, not a.no_cuda_graphs)
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the last runner's weights and KV are gone: free them for the next
            r["hbm_fraction"] = r["achieved_tbps"] / peak if peak else None
            rows.append(r)
    return {"card": card, "peak_tbps": peak, "model": spec.name, "torch": torch.__version__, "rows": rows}


def main(argv: list[str] | None = None) -> None:
    a = parse(argv)
    info = run(a)
    if a.json:
        print(json.dumps(info))
        return
    print(f"{info['card']}  peak {info['peak_tbps']} TB/s  {info['model']}  torch {info['torch']}")
    print(f"{'format':>6} {'EP':>3} {'batch':>5} {'graphs':>6} {'ms/step':>8} {'tok/s':>9} {'GB/step':>8} {'TB/s':>6} "
          f"{'of peak':>7}")
    for r in info["rows"]:
        frac = f"{r['hbm_fraction']:.0%}" if r["hbm_fraction"] is not None else "-"
        print(f"{r['format']:>6} {r['ep']:>3} {r['batch']:>5} {'yes' if r['cuda_graphs'] else 'no':>6} "
              f"{r['step_ms']:8.2f} {r['tokens_per_s']:9.1f} {r['bytes_per_step'] / 1e9:8.2f} "
              f"{r['achieved_tbps']:6.2f} {frac:>7}")


if __name__ == "__main__":
    main()
