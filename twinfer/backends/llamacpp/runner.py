"""LlamaCppRunner: a whole-model Runner over llama.cpp's low-level C API (llama-cpp-python's ctypes).
llama.cpp runs the forward pass; the engine keeps scheduling, sampling and prefix reuse. KV is one
unified cache of `n_ctx` cells, or one stream per sequence with `unified_kv=False` (docs/architecture.md,
"The runner contract")."""

from __future__ import annotations

import contextlib
import ctypes
import heapq
import os
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from twinfer.backends.llamacpp import hugepages, lazymap, paging, routing
from twinfer.backends.llamacpp._batch import BatchBuffer, check_images, decode_image, plan_windows
from twinfer.backends.llamacpp._lib import (
    MemoryOps,
    address_function,
    attach_threadpool,
    library_path,
    load_llama_cpp,
    set_quiet,
    versions,
)
from twinfer.backends.llamacpp.amx import guard_amx, quiet_amx_notice
from twinfer.backends.llamacpp.kv_port import LlamaCppKVPort
from twinfer.backends.llamacpp.metadata import model_desc, model_spec
from twinfer.backends.llamacpp.offload import AppliedPlacement, apply_placement
from twinfer.backends.llamacpp.options import BLOCK_SIZE, KV_TYPES, LlamaCppOptions
from twinfer.backends.llamacpp.slots import SlotKVSync
from twinfer.backends.llamacpp.vision import LlamaCppVision, open_projector
from twinfer.runtime.batch import LogitsWanted, SeqChunk, StepBatch
from twinfer.runtime.cpu import default_threads, thp_mode
from twinfer.runtime.errors import ModelError
from twinfer.runtime.kv.block_manager import BlockManager
from twinfer.runtime.kv.traffic import StepTraffic, kv_layer_bytes
from twinfer.runtime.runner import ExactShapes, KVLayout, KVSync, Runner
from twinfer.runtime.spec import ModelSpec

if TYPE_CHECKING:
    from twinfer.planners.placement import Placement

# Bytes per KV element of each cache type (q8_0/q4_0: 32-element blocks of 34 and 18 bytes).
KV_TYPE_BYTES = {"f32": 4.0, "f16": 2.0, "q4_0": 18 / 32, "q8_0": 34 / 32, "bf16": 2.0}
# Exact steps hold at most this many one-token rows: 8+ take another matmul path (see LlamaCppRunner).
EXACT_DECODE_ROWS = 7
_PAD_SEQ = -1  # the runner's own sequence that pads a lone row in exact steps


class DecodeError(RuntimeError):
    """llama_decode failed. Every sequence in the step is left holding exactly its chunk's `start` positions."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


class KVCacheFull(DecodeError):
    """llama_decode found no free KV cells for the batch (return code 1): free or preempt sequences."""


def _load_model(lib: ModuleType, path: Path, repack: bool, huge_pages: bool | None,
                placement: Placement | None = None, paged: bool = False) -> tuple[Any, int, AppliedPlacement]:
    """The model, its weight bytes on huge pages (None: decided from the host), and its placement; `paged`
    maps the file without reading it all (lazymap.py)."""
    if not path.exists():
        raise ModelError(f"model file not found: {path}")
    if not path.is_file():
        raise ModelError(f"{path} is a directory; the llama.cpp runner needs a .gguf file")
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelError(f"{path} is not a GGUF file (no GGUF magic at its start); pass a .gguf model")
    params = lib.llama_model_default_params()
    if hasattr(params, "use_extra_bufts"):
        params.use_extra_bufts = repack  # CPU weight repacking: its 4-row GEMM tiles break batch invariance
    placed = apply_placement(lib, params, placement)
    if huge_pages is None:
        huge_pages = hugepages.wanted(path.stat().st_size, thp_mode(), hugepages.mem_available())
    load = callback = None
    fields = {name for name, _ in type(params)._fields_}
    able = hugepages.supported() and bool(fields & {"load_mode", "use_mmap"}) and hasattr(lib, "llama_progress_callback")
    if huge_pages and able:  # asked for, or wanted here; nothing to do off Linux
        load = hugepages.HugePageLoad()
        callback = lib.llama_progress_callback(load.progress)  # referenced until the load returns
        if "load_mode" in fields:
            params.load_mode = lib.LLAMA_LOAD_MODE_NONE  # read into llama.cpp's buffers, not mapped
        else:
            params.use_mmap = False
        params.progress_callback = callback
    library = library_path(lib)
    with lazymap.unpopulated(library) if paged and library else contextlib.nullcontext(0):
        model = lib.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        raise ModelError(
            f"llama.cpp could not load {path}: the file is corrupt or truncated, or its architecture is "
            "not supported by this llama.cpp; check the file (run with verbose=True for llama.cpp's log)"
        )
    return model, load.finish() if load is not None else 0, placed


def _context_params(lib: ModuleType, o: LlamaCppOptions, n_cells: int, n_threads: int) -> Any:
    """llama.cpp's context parameters for `o`, with `n_cells` KV cells in all."""
    params = lib.llama_context_default_params()
    fields = {name for name, _ in type(params)._fields_}
    params.n_ctx, params.n_batch, params.n_ubatch = n_cells, o.n_batch, min(o.n_ubatch, o.n_batch)
    params.type_k = params.type_v = KV_TYPES[o.kv_type]
    params.n_seq_max = o.max_seqs
    params.n_threads = params.n_threads_batch = n_threads
    unified_kv, flash_attn = o.unified_kv, o.flash_attn
    params.no_perf = True
    if "kv_unified" in fields:
        params.kv_unified = unified_kv  # True: any sequence may use every cell, not n_ctx / n_seq_max of them
    elif not unified_kv:
        raise ValueError("llama.cpp runner: this llama.cpp has no per-sequence KV streams (kv_unified)")
    if "swa_full" in fields:
        params.swa_full = True  # keep sliding-window layers' full history so rollback and seq_cp stay exact
    if "flash_attn_type" in fields:
        params.flash_attn_type = (
            lib.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
    elif "flash_attn" in fields:
        params.flash_attn = flash_attn
    if "logits_all" in fields:
        params.logits_all = False  # per-token flags in the batch decide which rows come back
    return params


class LlamaCppRunner(Runner):
    """Runs a GGUF model with llama.cpp. Called by the engine from one thread, one step at a time.
    Sequence ids are the engine's; a llama seq slot is taken on a sequence's first chunk (or as a
    `copy_prefix` destination) and given back by `release`. A chunk must start at or before the
    sequence's stored length: earlier starts drop the positions from `start` on (rollback). llama.cpp's
    CPU kernels are not batch-invariant, hence `exact_shapes()`; why these shapes, the KV layouts and the
    step's split into calls are in docs/architecture.md, "The runner contract"."""

    backend = "llamacpp"
    # llama-server's n_batch: a wave of prompts prefills in one step, so its requests finish together
    step_tokens = 2048

    def __init__(self, path: str | os.PathLike[str], options: LlamaCppOptions | None = None, *,
                 spec: ModelSpec | None = None):
        self._closed = True  # until everything below exists, close() has nothing to free
        o = options or LlamaCppOptions()
        max_seqs, n_ctx = o.max_seqs, o.n_ctx
        lib = load_llama_cpp()
        if max_seqs > lib.llama_max_parallel_sequences():
            raise ValueError(
                f"max_seqs={max_seqs} exceeds llama.cpp's limit of {lib.llama_max_parallel_sequences()}"
            )
        set_quiet(lib, not o.verbose)
        self._lib = lib
        self.path = Path(path)
        self.n_threads = o.n_threads or default_threads()
        self.amx = guard_amx()
        repack = o.repack and self.amx != "repack-off"  # crashing AMX kernels we could not keep out otherwise
        self.flash_attn, self.repack, self.kv_type = o.flash_attn, repack, o.kv_type
        # mapped weights with experts paged under a bound (paging.py): which mappings are llama.cpp's
        maps_before = paging.read_maps() if o.paged_experts_bytes is not None else ""
        with quiet_amx_notice(self.amx == "denied" and not o.verbose):
            self._model, self.huge_page_bytes, self.placed = _load_model(lib, self.path, repack, o.huge_pages,
                                                                         o.placement, o.paged_experts_bytes is not None)
        self.pager = (paging.ExpertPager.attach(self.path, maps_before, o.paged_experts_bytes)
                      if o.paged_experts_bytes is not None else None)
        self.unified_kv = unified_kv = o.unified_kv
        total = n_ctx if unified_kv else n_ctx * max_seqs  # per-sequence streams: n_ctx cells each
        params = _context_params(lib, o, total, self.n_threads)
        # a paged model reads each layer's routed experts ahead of its matmuls (routing.Prefetch)
        self._route_hook = (lib.ggml_backend_sched_eval_callback(routing.Prefetch(self.pager).callback)
                            if self.pager is not None else None)  # referenced until the context is freed
        if self._route_hook is not None:
            params.cb_eval, params.cb_eval_user_data = self._route_hook, None
        before = hugepages.snapshot() if self.huge_page_bytes else None
        self._ctx = lib.llama_init_from_model(self._model, params)
        if not self._ctx:
            self._free_model()
            raise ModelError(
                f"llama.cpp could not create a context for {self.path} with n_ctx={n_ctx}, "
                f"max_seqs={max_seqs}; try a smaller n_ctx"
            )
        self._images: BatchBuffer | None = None  # embeddings of image rows, allocated on the first image
        self.vision: LlamaCppVision | None = None
        try:
            self._mem = MemoryOps.for_context(lib, self._ctx)
            self._batch = BatchBuffer(lib, int(lib.llama_n_batch(self._ctx)))
            self._free_threadpool = attach_threadpool(lib, self._ctx, self.n_threads)
        except BaseException:
            lib.llama_free(self._ctx)
            self._free_model()
            raise
        self._closed = False
        # fold the KV cache onto huge pages when no bigger than the weights: folding copies it
        # (docs/architecture.md, "The runner contract"; docs/benchmarks.md, "Weights on huge pages")
        context = hugepages.mapped_since(before) if before is not None else []
        self.huge_page_context_bytes = hugepages.fold(context, limit=self.path.stat().st_size)
        self.n_ctx = int(lib.llama_n_ctx(self._ctx))
        self.n_vocab = int(lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self._model)))
        self.spec = spec or model_spec(lib, self._model, self.path, self.n_vocab)
        try:
            self.vision = open_projector(lib, self._model, self.path, o.mmproj, self.spec, self.n_threads, o.verbose)
        except BaseException:
            self.close()
            raise
        # llama.cpp rounds the cache up (to a multiple of 256 cells): report the real capacity
        seq_tokens = None if unified_kv else self.n_ctx // max_seqs
        # recurrent/hybrid state cannot be cut back to a position: no prefix copies, no drafts
        recurrent = bool(lib.llama_model_is_recurrent(self._model) or lib.llama_model_is_hybrid(self._model))
        self.kv = KVLayout(
            block_size=BLOCK_SIZE, num_blocks=self.n_ctx // BLOCK_SIZE, paged=False, max_seqs=max_seqs,
            seq_tokens=seq_tokens, copies_prefix=not unified_kv and not recurrent, recurrent=recurrent,
        )
        self._slots: dict[int, int] = {}  # engine seq id -> llama seq id
        self._logits_address = address_function(lib, "llama_get_logits")
        self._logits_key: tuple[int | None, int] | None = None  # (address, rows) of `_logits_view`
        self._logits_view = np.empty((0, self.n_vocab), np.float32)
        self._free_slots = list(range(max_seqs))  # a heap: the lowest free id first, so streams stay consecutive
        self.slot_moves = 0  # sequences moved into another stream to keep a step's slots one run (_one_run)
        self.slot_drops = 0  # kept sequences (prefix cache) whose slots a step's run took (_one_run)
        self.kept: SlotKVSync | None = None  # the engine's KV sync, which keeps finished sequences' prefixes
        self._weight_bytes = int(lib.llama_model_size(self._model))
        per_token = self.spec.kv_bytes_per_token(KV_TYPE_BYTES[self.kv_type])
        self._stream_bytes = int(per_token * (self.n_ctx // max_seqs))  # what moving a sequence copies
        self.traffic = self._traffic()
        self.kv_port = LlamaCppKVPort(self)

    # -- Runner ------------------------------------------------------------------------------------
    def step(self, batch: StepBatch) -> np.ndarray:
        """Decode every chunk (split into n_batch-sized llama_decode calls); logits in batch order."""
        return self._step(batch, borrow=False)

    def step_borrowed(self, batch: StepBatch) -> np.ndarray:
        """`step`; a one-call step returns a view of llama.cpp's logits buffer, valid until the next decode."""
        return self._step(batch, borrow=True)

    def _step(self, batch: StepBatch, borrow: bool) -> np.ndarray:
        self._check_open()
        if batch.exact and batch.num_tokens == 1 and self.kv.max_seqs > 1:  # see the class docstring
            padded = StepBatch([*batch.chunks, SeqChunk(_PAD_SEQ, [0], 0, logits=LogitsWanted.NONE)])
            try:
                return self._decode(padded, borrow)
            finally:
                self.release(_PAD_SEQ)  # free its cell now: the next token of the lone row takes it
        return self._decode(batch, borrow)

    def exact_shapes(self) -> ExactShapes:
        """Shapes that keep logits batch-invariant here (the class docstring says why these)."""
        return ExactShapes(decode_rows=EXACT_DECODE_ROWS, reserved_seqs=1 if self.kv.max_seqs > 1 else 0)

    def kv_sync(self, blocks: BlockManager, slots: int, running: Callable[[], int]) -> KVSync:
        """Per-sequence slots follow the engine's blocks: prefix copies and kept sequences (slots.py)."""
        self.kept = SlotKVSync(self, blocks, slots, running)
        return self.kept

    def _decode(self, batch: StepBatch, borrow: bool = False) -> np.ndarray:
        chunks = batch.chunks
        slots = self._prepare(chunks)
        if self.unified_kv:
            return self._decode_in_order(batch, chunks, slots, borrow)
        order = sorted(range(len(chunks)), key=slots.__getitem__)
        if order == list(range(len(chunks))):
            return self._decode_in_order(batch, chunks, slots, borrow)
        # Streams: llama.cpp cuts ubatches of consecutive increasing seq ids, so out-of-order chunks each
        # cost a pass over the weights. Decode in slot order, hand rows back in batch order.
        ordered = self._decode_in_order(batch, [chunks[i] for i in order], [slots[i] for i in order])
        rows = [c.logit_rows for c in chunks]
        at = np.cumsum([0, *rows])  # each chunk's first row in batch order
        sources = [np.arange(at[i], at[i] + rows[i]) for i in order]
        out = np.empty_like(ordered)
        out[np.concatenate(sources)] = ordered
        return out

    def _decode_in_order(self, batch: StepBatch, chunks: list[SeqChunk], slots: list[int],
                         borrow: bool = False) -> np.ndarray:
        windows = plan_windows(chunks, self._batch.capacity)
        out = None if borrow and len(windows) == 1 else np.empty((batch.num_logit_rows, self.n_vocab), np.float32)
        row = 0
        for pieces in windows:
            if pieces[0].image >= 0:  # an image's rows: embeddings, in a batch of their own
                n_out, code = decode_image(self._lib, self._ctx, self._image_batch(), chunks[pieces[0].chunk],
                                           pieces[0], slots[pieces[0].chunk])
            else:
                n_out = self._batch.fill(chunks, pieces, slots)
                code = int(self._lib.llama_decode(self._ctx, self._batch.raw))
            if code != 0:
                self._truncate_to_starts(chunks, slots)
                raise self._decode_error(code, batch)
            if self.pager is not None:
                self.pager.after_step()
            if not n_out:
                continue
            # Output rows are contiguous in batch order (llama.cpp undoes its ubatch reordering).
            rows = self._logits_rows(n_out)
            if out is None:
                return rows
            out[row : row + n_out] = rows
            row += n_out
        return out if out is not None else np.empty((0, self.n_vocab), np.float32)

    def _image_batch(self) -> BatchBuffer:
        if self._images is None:
            self._images = BatchBuffer(self._lib, self._batch.capacity, int(self._lib.llama_model_n_embd(self._model)))
        return self._images

    def _logits_rows(self, n_out: int) -> np.ndarray:
        """llama.cpp's logits buffer as [n_out, n_vocab] float32, not copied; the view is cached per
        (address, rows) because numpy builds a ctypes type per new view."""
        key = (self._logits_address(self._ctx), n_out)
        if key != self._logits_key:
            if not key[0]:
                raise DecodeError("llama.cpp returned no logits buffer after a decode that asked for logits", -1)
            ptr = ctypes.cast(key[0], ctypes.POINTER(ctypes.c_float))
            self._logits_view = np.ctypeslib.as_array(ptr, shape=(n_out, self.n_vocab))
            self._logits_key = key
        return self._logits_view

    def release(self, seq_id: int) -> None:
        """Drop the sequence's KV and give its llama seq slot back (unknown ids: nothing to do)."""
        slot = self._slots.pop(seq_id, None)
        if slot is None or self._closed:
            return
        self._mem.seq_rm(slot, -1, -1)
        heapq.heappush(self._free_slots, slot)

    def truncate(self, seq_id: int, length: int) -> None:
        """Keep only the first `length` positions of the sequence (the engine keeps full blocks)."""
        slot = self._slots.get(seq_id)
        if slot is not None and not self._closed:
            self._mem.seq_rm(slot, length, -1)

    def copy_prefix(self, src_seq: int, dst_seq: int, num_tokens: int) -> None:
        """Make dst's KV exactly src's first `num_tokens` positions (shared cells, or a copied stream)."""
        self._check_open()
        if src_seq not in self._slots:
            raise ValueError(f"copy_prefix: source sequence {src_seq} has no KV in this runner")
        src = self._slots[src_seq]
        length = self._mem.seq_pos_max(src) + 1
        if not 0 <= num_tokens <= length:
            raise ValueError(
                f"copy_prefix: sequence {src_seq} holds {length} positions, cannot share {num_tokens}"
            )
        if src_seq == dst_seq:
            self._mem.seq_rm(src, num_tokens, -1)
            return
        dst = self._slot_for(dst_seq)
        self._mem.seq_rm(dst, -1, -1)
        if not num_tokens:
            return
        if self.unified_kv:
            self._mem.seq_cp(src, dst, 0, num_tokens)
            return
        # Streams: llama.cpp copies the whole stream at the next llama_decode; the tail is dropped after.
        self._mem.seq_cp(src, dst, -1, -1)
        self._mem.seq_rm(dst, num_tokens, -1)

    def adopt_prefix(self, src_seq: int, dst_seq: int, num_tokens: int) -> None:
        """Give `src_seq`'s slot to `dst_seq` (which holds none), keeping its first `num_tokens` positions."""
        self._check_open()
        if src_seq not in self._slots or dst_seq in self._slots:
            raise ValueError(f"adopt_prefix: sequence {src_seq} must hold a slot and {dst_seq} none")
        slot = self._slots.pop(src_seq)
        self._slots[dst_seq] = slot
        self._mem.seq_rm(slot, num_tokens, -1)

    def save_seq_state(self, seq_id: int) -> bytes:
        """The sequence's KV cells as llama.cpp serializes them (`llama_state_seq_get_data`)."""
        self._check_open()
        slot = self._slots.get(seq_id)
        if slot is None:
            raise ValueError(f"save_seq_state: sequence {seq_id} has no KV in this runner")
        size = int(self._lib.llama_state_seq_get_size(self._ctx, slot))
        buf = (ctypes.c_uint8 * size)()
        written = int(self._lib.llama_state_seq_get_data(self._ctx, buf, size, slot))
        return bytes(buf)[:written]

    def load_seq_state(self, seq_id: int, data: bytes) -> int:
        """Load what `save_seq_state` wrote; returns the positions held. ValueError if llama.cpp refuses."""
        self._check_open()
        slot = self._slot_for(seq_id)
        self._mem.seq_rm(slot, -1, -1)
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        if int(self._lib.llama_state_seq_set_data(self._ctx, buf, len(data), slot)) == 0:
            self.release(seq_id)
            raise ValueError(f"llama.cpp refused the KV state for sequence {seq_id} (no room, or another model's)")
        return self._length(seq_id)

    def _traffic(self) -> StepTraffic:
        """Every weight tensor is read by a step (an untied embedding only by its rows); KV in `kv_type`."""
        weights = float(self._lib.llama_model_size(self._model))
        if not self.spec.tie_word_embeddings:
            from twinfer.runtime.loaders.gguf_reader import GGUFContents

            embd = GGUFContents(self.path).tensors.get("token_embd.weight")
            weights -= embd.nbytes if embd is not None else 0
        # swa_full keeps every cell, but a sliding layer's query still reads only its window
        windows = tuple(self.spec.window(i) for i in range(self.spec.num_layers))
        return StepTraffic(weights, kv_layer_bytes(self.spec, KV_TYPE_BYTES[self.kv_type]), windows)

    def num_stored(self, seq_id: int) -> int:
        """Positions of the sequence held in the KV cache (0 for unknown sequences)."""
        self._check_open()
        return self._length(seq_id)

    def describe(self) -> dict[str, Any]:
        lib = self._lib
        info: dict[str, Any] = {
            "backend": self.backend,
            "device": "gpu" if lib.llama_supports_gpu_offload() and self.placed.n_gpu_layers != 0 else "cpu",
            "placement": self.placed.to_json(),  # n_gpu_layers (None: llama.cpp's default) and tensor overrides
            **versions(lib),
            "memory_api": self._mem.api,
            "n_threads": self.n_threads,
            "threadpool": "persistent" if self._free_threadpool is not None else "per-graph",  # ggml's CPU pool
            "n_ctx": self.n_ctx,
            "n_batch": self._batch.capacity,
            "n_ubatch": int(lib.llama_n_ubatch(self._ctx)) if not self._closed else None,
            "max_seqs": self.kv.max_seqs,
            "flash_attn": self.flash_attn,
            "repack": self.repack,
            "huge_page_weights_mb": round(self.huge_page_bytes / 2**20),  # 0: mapped or on 4 KiB pages
            "huge_page_context_mb": round(self.huge_page_context_bytes / 2**20),  # the KV cache's, mostly
            "paged_experts": self.pager.describe() if self.pager is not None else None,  # paging.py
            "slot_moves": self.slot_moves,
            "slot_drops": self.slot_drops,
            "amx": self.amx,  # none | on | denied (its kernels crash in this build: kept out) | repack-off
            "kv_type": self.kv_type,
            "unified_kv": self.unified_kv,
            "batch_invariant": self.flash_attn and not self.repack,
            "model_path": str(self.path),
            "model": model_desc(lib, self._model) if not self._closed else None,
            "n_vocab": self.n_vocab,
            "mmproj": str(self.vision.path) if self.vision is not None else None,
        }
        return info

    # -- lifetime ----------------------------------------------------------------------------------
    def close(self) -> None:
        """Free the batch, context and model. Safe to call twice; the runner is unusable afterwards."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        self._slots.clear()
        self._batch.free()
        if self._images is not None:
            self._images.free()
        if self.vision is not None:  # before the model it was made for
            self.vision.close()
        self._lib.llama_free(self._ctx)
        self._ctx = None
        if self._free_threadpool is not None:  # after the context that used it
            self._free_threadpool()
            self._free_threadpool = None
        self._free_model()

    def __del__(self) -> None:
        try:  # noqa: SIM105 - contextlib itself may be torn down at interpreter exit
            self.close()
        except Exception:  # noqa: BLE001, S110 - and so may ctypes
            pass

    def __enter__(self) -> LlamaCppRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------------------------
    def _free_model(self) -> None:
        free = getattr(self._lib, "llama_model_free", None) or self._lib.llama_free_model
        free(self._model)
        self._model = None

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this LlamaCppRunner is closed")

    def _slot_for(self, seq_id: int) -> int:
        slot = self._slots.get(seq_id)
        if slot is None:
            if not self._free_slots:
                raise ValueError(
                    f"sequence {seq_id}: all max_seqs={self.kv.max_seqs} llama.cpp sequence slots are "
                    "taken; release a finished sequence first"
                )
            slot = self._slots[seq_id] = heapq.heappop(self._free_slots)
        return slot

    def _length(self, seq_id: int) -> int:
        slot = self._slots.get(seq_id)
        return 0 if slot is None else self._mem.seq_pos_max(slot) + 1

    def _prepare(self, chunks: list[SeqChunk]) -> list[int]:
        """Check the chunks, take slots for new sequences, drop positions >= start. Returns slots."""
        seen: set[int] = set()
        lengths: list[int] = []
        for c in chunks:
            if c.seq_id in seen:
                raise ValueError(f"sequence {c.seq_id} has two chunks in one step")
            seen.add(c.seq_id)
            if min(c.tokens) < 0 or max(c.tokens) >= self.n_vocab:
                raise ValueError(f"sequence {c.seq_id}: token id outside the vocabulary [0, {self.n_vocab})")
            if c.images:
                check_images(c, int(self._lib.llama_model_n_embd(self._model)),
                             min(self._batch.capacity, int(self._lib.llama_n_ubatch(self._ctx))))
            length = self._length(c.seq_id)
            if c.start > length:
                raise ValueError(
                    f"sequence {c.seq_id}: chunk starts at position {c.start} but only {length} are stored"
                )
            lengths.append(length)
        new = sum(c.seq_id not in self._slots for c in chunks)
        if new > len(self._free_slots):
            raise ValueError(
                f"{new} new sequences but only {len(self._free_slots)} of max_seqs={self.kv.max_seqs} "
                "llama.cpp slots are free; release finished sequences first"
            )
        if not self.unified_kv and not self.kv.recurrent:
            self._one_run(chunks)
        slots = [self._slot_for(c.seq_id) for c in chunks]
        rollback = [i for i, c in enumerate(chunks) if c.start < lengths[i]]
        self._truncate_to_starts([chunks[i] for i in rollback], [slots[i] for i in rollback])
        return slots

    def _one_run(self, chunks: list[SeqChunk]) -> None:
        """Streams: llama.cpp cuts a step into ubatches of consecutive slots, each a pass over the weights (rows
        in slots 0-3 and 8-11 cost two). Give the step one run of slots: new sequences take free slots in it,
        held ones outside it move in (a whole-stream copy) where that costs less than a step's extra passes, and
        kept sequences (prefix cache) in it are dropped, the fewest first."""
        m, free = len(chunks), set(self._free_slots)
        mine = {self._slots[c.seq_id] for c in chunks if c.seq_id in self._slots}
        new = [c.seq_id for c in chunks if c.seq_id not in self._slots]
        anyway = sorted(mine | set(heapq.nsmallest(len(new), self._free_slots)))
        if m < 2 or anyway[-1] - anyway[0] == m - 1:
            return
        kept = {self._slots[s]: s for s in self.kept.retained if s in self._slots} if self.kept is not None else {}
        usable = free | mine | set(kept)
        windows = [w for lo in range(self.kv.max_seqs - m + 1) if usable >= (w := set(range(lo, lo + m)))]
        if not windows:
            return  # slots of running sequences outside the step split every run

        runs = 1 + sum(b != a + 1 for a, b in zip(anyway, anyway[1:], strict=False))
        saved = (runs - 1) * self._weight_bytes  # the extra passes of one step
        affordable = [w for w in windows if 2 * len(mine - w) * self._stream_bytes <= saved]
        if not affordable:
            return
        window = min(affordable,  # fewest kept prefixes lost, then fewest streams moved, then the lowest slots
                     key=lambda w: (len(w & kept.keys()), len(mine - w), min(w)))
        outside = sorted(mine - window)
        for slot in sorted(window & kept.keys()):
            assert self.kept is not None
            self.kept.drop_kept(kept[slot])  # releases the slot into the free heap
            self.slot_drops += 1
        free = set(self._free_slots)
        room = sorted(free & window)
        owner = {slot: seq for seq, slot in self._slots.items()}
        for src, dst in zip(outside, room, strict=False):
            self._mem.seq_cp(src, dst, -1, -1)  # llama.cpp copies the stream at the next llama_decode
            self._mem.seq_rm(src, -1, -1)
            self._slots[owner[src]] = dst
        self._slots.update(zip(new, room[len(outside):], strict=True))
        self._free_slots = sorted((free - set(room)) | set(outside))  # a sorted list is a heap
        self.slot_moves += len(outside)

    def _truncate_to_starts(self, chunks: list[SeqChunk], slots: list[int]) -> None:
        for c, slot in zip(chunks, slots, strict=True):
            if not self._mem.seq_rm(slot, c.start, -1):
                raise DecodeError(f"llama.cpp cannot drop positions >= {c.start} of sequence {c.seq_id}", -1)

    def _decode_error(self, code: int, batch: StepBatch) -> DecodeError:
        where = f"{len(batch.chunks)} sequences, {batch.num_tokens} tokens"
        if code == 1:
            return KVCacheFull(
                f"llama.cpp KV cache full ({self.n_ctx} cells) for a step of {where}; release or preempt sequences",
                code,
            )
        return DecodeError(f"llama_decode failed with code {code} for a step of {where}", code)
