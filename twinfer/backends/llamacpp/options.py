"""How a llama.cpp runner is built: `LlamaCppOptions`, checked once, and `options_for_mode`, the one
place a run mode (exact or fast) becomes llama.cpp's settings for every path that opens a runner."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from twinfer.planners.placement import Placement

# Accounting granularity only: llama.cpp allocates KV per token, the engine counts blocks of this size.
BLOCK_SIZE = 16
# KV-cache element types (ggml_type ids) the runner accepts; the planner names formats the same way.
KV_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 8, "bf16": 30}

# What a caller asks of the numerics: "fast" (llama.cpp's defaults, weights repacked), "row-invariant"
# (weights as stored: a row's logits do not depend on its place), "batch-invariant" (that, plus a KV
# stream per sequence, `serve --batch-invariant`).
RunMode = Literal["fast", "row-invariant", "batch-invariant"]
RUN_MODES: tuple[RunMode, ...] = ("fast", "row-invariant", "batch-invariant")


@dataclass(frozen=True)
class LlamaCppOptions:
    """Everything `LlamaCppRunner` reads besides the GGUF file and an optional spec."""

    n_ctx: int = 4096  # KV cells: shared by all sequences (unified) or each sequence's own (streams)
    max_seqs: int = 16
    n_threads: int | None = None  # None: runtime.cpu.default_threads()
    n_batch: int = 2048  # tokens per llama_decode call (llama-server's batch)
    n_ubatch: int = 512
    flash_attn: bool = True
    repack: bool = False  # llama.cpp's weight repacking (use_extra_bufts): faster, not row-invariant
    kv_type: str = "f16"
    unified_kv: bool = True  # False: a stream of n_ctx cells per sequence
    huge_pages: bool | None = None  # None: decide from the host and the file's size (hugepages.wanted)
    # weights mapped, dense ones resident, routed experts' pages held under this many bytes (paging.py)
    paged_experts_bytes: int | None = None
    placement: Placement | None = None  # a plan's GPU layers and expert tensors (offload.py); None: llama.cpp's
    mmproj: str = "off"  # the projector file images go through (vision.py): a path, "off", or "auto" (a sibling)
    verbose: bool = False

    def __post_init__(self) -> None:
        if (self.n_ctx < BLOCK_SIZE or self.n_batch < 1 or self.n_ubatch < 1 or self.max_seqs < 1
                or (self.n_threads is not None and self.n_threads < 1)):
            raise ValueError(
                f"llama.cpp runner: need n_ctx >= {BLOCK_SIZE}, n_batch >= 1, n_ubatch >= 1, max_seqs >= 1, "
                f"n_threads >= 1 (got n_ctx={self.n_ctx}, n_batch={self.n_batch}, n_ubatch={self.n_ubatch}, "
                f"max_seqs={self.max_seqs}, n_threads={self.n_threads})"
            )
        if self.paged_experts_bytes is not None:
            if self.paged_experts_bytes < 0 or self.huge_pages:
                raise ValueError("llama.cpp runner: paged experts need mapped weights (huge_pages not True) and "
                                 f"a bound >= 0 bytes (got {self.paged_experts_bytes})")
            object.__setattr__(self, "huge_pages", False)  # mapped: never read into anonymous memory
            object.__setattr__(self, "repack", False)  # repacked tensors are copied out of the mapping
        if self.kv_type not in KV_TYPES:
            raise ValueError(f"llama.cpp runner: kv_type {self.kv_type!r} is not one of {', '.join(KV_TYPES)}")
        if self.kv_type in ("q8_0", "q4_0") and not self.flash_attn:
            raise ValueError(f"llama.cpp runner: a {self.kv_type} KV cache needs flash_attn=True (llama.cpp's V cache)")
        if self.placement is not None and self.placement.kv_type != self.kv_type:
            raise ValueError(f"llama.cpp runner: the placement's KV type {self.placement.kv_type} is not "
                             f"kv_type {self.kv_type}")


def options_for_mode(mode: RunMode, *, n_ctx: int, max_seqs: int, n_threads: int | None = None,
                     kv_type: str | None = None, streams: bool = False,
                     placement: Placement | None = None) -> LlamaCppOptions:
    """The runner options for `mode`; `streams`: a KV stream per sequence; `placement`: a plan's (its KV
    type unless `kv_type`). Batch-invariant runs always get streams, and only "fast" repacks weights
    (both for exactness: docs/architecture.md, "The runner contract")."""
    if mode not in RUN_MODES:
        raise ValueError(f"llama.cpp runner: mode {mode!r} is not one of {', '.join(RUN_MODES)}")
    kv = kv_type or (placement.kv_type if placement is not None else "f16")
    return LlamaCppOptions(n_ctx=n_ctx, max_seqs=max_seqs, n_threads=n_threads, kv_type=kv, placement=placement,
                           repack=mode == "fast", unified_kv=not (streams or mode == "batch-invariant"))
