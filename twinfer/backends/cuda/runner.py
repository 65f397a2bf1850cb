"""Build the torch backend's runner (`graphs.TorchRunner`) from a loaded model or from canonical-name weights."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from twinfer.backends.cuda.formats import convert_weight, native_weight_format
from twinfer.backends.cuda.graphs import TorchRunner, ops_protocol
from twinfer.backends.cuda.kv_port import TorchKVPort
from twinfer.backends.cuda.ops import TorchOps
from twinfer.runtime.kv.recurrent import DRAFT_ROLLBACK
from twinfer.runtime.kv.traffic import StepTraffic, held_bytes, resident_traffic
from twinfer.runtime.runner import KVLayout
from twinfer.runtime.spec import ModelSpec

if TYPE_CHECKING:
    from twinfer.runtime.loaders import LoadedModel


@dataclass(frozen=True)
class TorchOptions:
    """How `build_torch_runner` builds a runner: a paged KV cache of `kv_tokens` positions in blocks of
    `block_size`. `kv_format` ("tq4", "tq2.5", "tq3-qjl"; None: dense) codes the KV cache with TurboQuant.
    `weight_format` "fp8" stores the dense projections as FP8 (formats.py); on a GPU a format it
    cannot multiply natively is refused. `kernels`: "auto" (triton on CUDA), "triton" or "torch";
    `cuda_graphs`: replay decode steps from CUDA graphs on a GPU (graphs.py). `padded_steps`: keep the
    scratch KV block of padded decode steps (default: only where CUDA graphs can run; True lets a CPU
    test call `step_padded`). `packed_weights`: keep a published checkpoint's fp8/nvfp4/mxfp4 weights in
    their bytes, the datacenter target (default: on a GPU); otherwise they are dequantized at load."""

    device: str | torch.device = "cpu"
    dtype: torch.dtype = torch.float32
    kv_tokens: int = 4096
    block_size: int = 16
    kv_format: str | None = None
    weight_format: str | None = None
    kernels: str | None = None
    cuda_graphs: bool = True
    padded_steps: bool | None = None
    packed_weights: bool | None = None

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.kv_tokens < self.block_size:
            raise ValueError(f"KV cache of {self.kv_tokens} tokens in blocks of {self.block_size}: "
                             "need kv_tokens >= block_size > 0")

    @property
    def on_gpu(self) -> bool:
        return torch.device(self.device).type == "cuda"


def load_torch_runner(loaded: LoadedModel, options: TorchOptions | None = None, **fields: Any) -> TorchRunner:
    """`build_torch_runner` (same options) for a model from `runtime.loaders.load_model`: its weight set
    is the mapping, so each weight is read from the file and moved to the device one at a time. A checkpoint
    with a vision tower gets it as `runner.vision`, on the runner's device and dtype."""
    from twinfer.runtime.vision.towers import open_vision

    runner = build_torch_runner(loaded.spec, loaded.weights, options, **fields)
    runner.vision = open_vision(loaded, ops_protocol(runner.torch_ops))
    return runner


def build_torch_runner(spec: ModelSpec, weights: Mapping[str, Any], options: TorchOptions | None = None,
                       **fields: Any) -> TorchRunner:
    """A torch runner from canonical-name -> host tensor (numpy float32 or QuantizedWeight) weights, read
    one at a time, built as `options` says; `fields` set single `TorchOptions` fields over it
    (`build_torch_runner(spec, weights, kv_tokens=64)`)."""
    o = replace(options or TorchOptions(), **fields)
    fmt = native_weight_format(o.weight_format, torch.device(o.device))
    packed_weights = o.on_gpu if o.packed_weights is None else o.packed_weights
    block_size = o.block_size
    kv = KVLayout(block_size=block_size, num_blocks=-(-o.kv_tokens // block_size), recurrent=spec.recurrent,
                  state_rollback=DRAFT_ROLLBACK if spec.recurrent else 0)  # recurrent.py keeps drafts' states
    padded_steps = o.cuda_graphs and o.on_gpu if o.padded_steps is None else o.padded_steps
    ops = TorchOps(  # padded decode steps get one block more than the engine sees: their rows' scratch
        spec, num_blocks=kv.num_blocks + int(padded_steps), block_size=block_size, device=o.device, dtype=o.dtype,
        kv_format=o.kv_format, kernels=o.kernels, packed_weights=packed_weights,
    )
    converted = {}
    for name in weights:
        if name == "lm_head" and spec.tie_word_embeddings:
            continue  # tied: the model reads `embed`; keep one copy on the device
        converted[name] = convert_weight(name, ops.weight(name, weights[name]), fmt)
    runner = TorchRunner(spec, ops, converted, kv, cuda_graphs=o.cuda_graphs, padded_steps=padded_steps)
    runner.kv_port = TorchKVPort(ops)  # a recurrent model's linear-attention layers send their state
    runner.traffic = torch_traffic(spec, converted, ops, (kv.num_blocks + int(padded_steps)) * block_size)
    return runner


def torch_traffic(spec: ModelSpec, weights: Mapping[str, Any], ops: TorchOps, slots: int) -> StepTraffic:
    """What a step reads and writes: every resident weight (`kv.traffic.resident_traffic`'s accounting)
    and the KV cache's bytes per slot (`slots`: the cache's positions; TurboQuant codes added when coded)."""
    tq = [int(c.nbytes) for c in ops.kv_quant] or [0] * spec.num_layers
    layers = tuple((int(k.nbytes) + int(v.nbytes) + q) / slots
                   for k, v, q in zip(ops.k_cache, ops.v_cache, tq, strict=True))
    return resident_traffic(spec, {n: float(held_bytes(w, torch.Tensor)) for n, w in weights.items()}, layers)


def open_torch_runner(loaded: LoadedModel, *, kv_tokens: int, threads: int | None = None, dtype: str | None = None,
                      device: str | None = None) -> TorchRunner:
    """`load_torch_runner` with the CLI's defaults: CUDA when there is one (bfloat16), else CPU (float32);
    `threads` caps torch's CPU threads; `dtype` names a torch dtype ("float16", "bfloat16", ...)."""
    if threads:
        torch.set_num_threads(threads)
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    default = torch.bfloat16 if dev.startswith("cuda") else torch.float32
    return load_torch_runner(loaded, device=dev, dtype=getattr(torch, dtype) if dtype else default, kv_tokens=kv_tokens)
