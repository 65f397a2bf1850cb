"""Batch-1 active-parameter MoE: routed experts stay in the model file, read on demand into an LRU
`ExpertCache` bounded in bytes, the next layer's guess prefetched (docs/architecture.md)."""

from __future__ import annotations

import contextlib
import mmap
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from twinfer.runtime.errors import ModelError, PlanError
from twinfer.runtime.loaders.gguf_file import GGUFTensor
from twinfer.runtime.loaders.gguf_reader import TensorInfo
from twinfer.runtime.loaders.safetensors_file import SafetensorsTensor
from twinfer.runtime.loaders.weights import StoredTensor, WeightSet
from twinfer.runtime.spec import ModelSpec

PARTS = ("gate", "up", "down")
ExpertArrays = tuple[Any, Any, Any]  # gate [I, C], up [I, C], down [C, I] on the backend


@dataclass(frozen=True)
class Routed:
    """One expert's share of an MoE step: its id, the rows routed to it (`tok`), the top-k slot that
    picked it in each of those rows (`slot`), and the step's routing weights [T, k] on the backend."""

    expert: int
    tok: np.ndarray
    slot: np.ndarray
    weights: Any


@dataclass(frozen=True)
class ExpertHandle:
    """Stands in the weights dict for a streamed `layers.{layer}.experts.{part}` tensor."""

    layer: int
    part: str
    shape: tuple[int, ...]


def is_expert_weight(name: str) -> bool:
    """A routed expert's stacked gate, up or down matrix (their biases, [E, I] / [E, C], stay resident)."""
    return name.startswith("layers.") and ".experts." in name and name.rsplit(".", 1)[1] in PARTS


def expert_params(spec: ModelSpec) -> int:
    """Parameters of one routed expert (gate, up and down)."""
    assert spec.moe is not None
    return 3 * spec.moe.expert_intermediate_size * spec.hidden_size


# -- reading one expert from the file ----------------------------------------------------------------
def _expert_slice(t: StoredTensor, e: int, n: int, keep_axis: bool = False) -> StoredTensor:
    """Part `e` of `n` equal parts of a stored tensor's outermost axis, without reading the others: an
    expert of [E, ...] (the axis goes), or with `keep_axis` a block of rows (gate or up of [2I, C])."""
    size = t.nbytes // n
    shape = (t.shape[0] // n, *t.shape[1:]) if keep_axis else t.shape[1:]
    if isinstance(t, SafetensorsTensor):
        return replace(t, shape=shape, nbytes=size, offset=t.offset + e * size)
    if isinstance(t, GGUFTensor):
        info = t.info
        ne = (*info.ne[:-1], info.ne[-1] // n) if keep_axis else info.ne[:-1]
        sub = TensorInfo(info.name, ne, info.ggml_type, info.offset + e * size, size)
        return replace(t, shape=shape, nbytes=size, info=sub)
    raise ModelError(f"expert streaming cannot slice tensor {t.name!r} stored as {type(t).__name__}")


def _drop_pages(t: StoredTensor) -> None:
    """Forget the tensor's pages in this process's mapping; the page cache keeps them for a re-read."""
    if isinstance(t, SafetensorsTensor):
        m, offset = getattr(t.data, "_mmap", None), t.offset
    elif isinstance(t, GGUFTensor):
        m, offset = getattr(t.contents, "_map", None), t.info.offset
    else:
        return
    if not isinstance(m, mmap.mmap) or not hasattr(m, "madvise"):
        return
    page = mmap.PAGESIZE
    start = offset // page * page
    end = min(len(m), -(-(offset + t.nbytes) // page) * page)
    with contextlib.suppress(OSError, ValueError):  # advisory: the read itself succeeded
        m.madvise(mmap.MADV_DONTNEED, start, end - start)


def release_pages(weights: WeightSet, names: Sequence[str]) -> None:
    """Drop the file pages that loading `names` touched, so only the backend's copies stay resident."""
    for name in names:
        for src in weights.sources(name):
            _drop_pages(src)


def streaming_weights(weights: WeightSet, spec: ModelSpec, put: Callable[[str, np.ndarray], Any]
                      ) -> tuple[dict[str, Any], dict[int, Any]]:
    """The runner weights of an expert-streaming model: routed experts as `ExpertHandle`s (read on
    demand), every other weight through `put` (the backend's upload; a tied lm_head is skipped), then
    the uploaded weights' file pages dropped. Also the routers by MoE layer, for `StreamingOps`."""
    out: dict[str, Any] = {}
    for name in weights.names():
        if name == "lm_head" and spec.tie_word_embeddings:
            continue
        if is_expert_weight(name):
            layer, part = int(name.split(".")[1]), name.rsplit(".", 1)[1]
            out[name] = ExpertHandle(layer, part, weights.shape(name))
        else:
            out[name] = put(name, weights.load(name))
    release_pages(weights, [n for n in weights.names() if not is_expert_weight(n)])
    routers = {i: out[f"layers.{i}.router"] for i in range(spec.num_layers) if spec.is_moe_layer(i)}
    return out, routers


class ExpertReader:
    """Reads one expert's (gate, up, down) float32 host arrays, per-expert or stacked [E, ...] tensors
    (any transform keeping the expert axis first); safe to call from a reader thread."""

    def __init__(self, weights: WeightSet):
        self.weights = weights
        spec = weights.spec
        if spec.moe is None:
            raise ModelError(f"{spec.name or spec.model_type} has no experts to stream")
        self.num_experts = spec.moe.num_experts
        self._layer_bytes: dict[int, int] = {}  # stored bytes of one expert, by layer

    def read(self, layer: int, expert: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        gate, up, down = (self._part(layer, expert, p) for p in PARTS)
        return gate, up, down

    def stored_bytes(self, layer: int, expert: int) -> int:
        """Bytes this expert occupies in the file (what a miss reads); every expert of a layer is the same size."""
        total = self._layer_bytes.get(layer)
        if total is None:
            total = self._layer_bytes[layer] = sum(
                self.weights.nbytes_stored(f"layers.{layer}.experts.{p}") // self.num_experts for p in PARTS)
        return total

    def _part(self, layer: int, e: int, part: str) -> np.ndarray:
        name = f"layers.{layer}.experts.{part}"
        sources, transform = self.weights.sources(name), self.weights.transform(name)
        if transform == "stack_experts":
            src = sources[e]
        elif transform in (None, "gate_half", "up_half") and len(sources) == 1:
            src = _expert_slice(sources[0], e, self.num_experts)
        else:
            return self._transformed(name, e)
        if transform in ("gate_half", "up_half"):  # [2I, C]: gate rows then up rows; read only this half
            src = _expert_slice(src, int(transform == "up_half"), 2, keep_axis=True)
        values = _read_owned(src)
        _drop_pages(src)
        return values

    def _transformed(self, name: str, e: int) -> np.ndarray:
        """Expert `e` of a weight whose transform keeps the expert axis first (gpt-oss's interleaved
        gate/up columns, transposed or MXFP4 experts): the transform runs on that expert's slice of
        every source, [1, ...] each."""
        sources, impl = self.weights.sources(name), self.weights.transform_impl(name)
        if impl is None or impl.many or any(s.shape[0] != self.num_experts for s in sources):
            raise ModelError(f"expert streaming cannot read {name!r} (stored with transform "
                             f"{self.weights.transform(name)!r})")
        slices = [_expert_slice(s, e, self.num_experts, keep_axis=True) for s in sources]
        values = impl.apply([_read_owned(s) for s in slices], self.weights.spec)[0]
        out = _owned(values.shape)
        out[...] = values
        for s in slices:
            _drop_pages(s)
        return out


def _owned(shape: tuple[int, ...]) -> np.ndarray:
    """A float32 array in its own anonymous mapping, returned to the OS when freed (malloc's per-thread
    arenas would let a churning cache hold up to twice its budget)."""
    count = int(np.prod(shape)) if shape else 1
    buf = mmap.mmap(-1, max(count * 4, 1))
    return np.frombuffer(buf, dtype=np.float32, count=count).reshape(shape)


_RAW = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}


def _read_owned(src: StoredTensor) -> np.ndarray:
    """`src.read()` into an `_owned` array, straight from the file mapping for float safetensors."""
    out = _owned(tuple(src.shape))
    if isinstance(src, SafetensorsTensor) and src.dtype in _RAW:
        raw_dtype = np.dtype(_RAW[src.dtype])
        raw = np.frombuffer(src.data, dtype=raw_dtype, count=src.nbytes // raw_dtype.itemsize, offset=src.offset)
        if src.dtype == "BF16":  # bf16 is the top half of a float32
            bits = out.reshape(-1).view(np.uint32)
            bits[...] = raw
            bits <<= 16
        else:
            out.reshape(-1)[...] = raw
        return out
    out[...] = src.read()
    return out


# -- the cache ---------------------------------------------------------------------------------------
@dataclass
class ExpertStats:
    """What streaming cost. `hit_rate` counts prefetched experts as hits (no synchronous read)."""

    lookups: int = 0
    hits: int = 0
    prefetch_hits: int = 0
    misses: int = 0
    prefetched: int = 0
    bytes_read: int = 0
    stall_s: float = 0.0
    tokens: int = 0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        return (self.hits + self.prefetch_hits) / self.lookups if self.lookups else 0.0

    @property
    def bytes_per_token(self) -> float:
        return self.bytes_read / self.tokens if self.tokens else 0.0

    def as_dict(self) -> dict[str, float | int]:
        return {"lookups": self.lookups, "hits": self.hits, "prefetch_hits": self.prefetch_hits,
                "misses": self.misses, "prefetched": self.prefetched, "evictions": self.evictions,
                "hit_rate": self.hit_rate, "bytes_read": self.bytes_read, "tokens": self.tokens,
                "bytes_per_token": self.bytes_per_token, "stall_s": self.stall_s}


@dataclass
class ExpertCache:
    """LRU cache of experts on the backend, bounded by `capacity_bytes` (reads in flight included).
    `fetch` runs on the model's thread, `prefetch` queues reads on one reader thread."""

    reader: ExpertReader
    to_device: Callable[[np.ndarray], Any]
    capacity_bytes: int
    expert_bytes: int  # one expert as the backend holds it
    min_experts: int  # the most experts one layer's compute holds at once (top_k)
    prefetch_enabled: bool = True
    on_evict: Callable[[], None] | None = None
    stats: ExpertStats = field(default_factory=ExpertStats)

    def __post_init__(self) -> None:
        if self.capacity_bytes < self.min_experts * self.expert_bytes:
            raise PlanError(
                f"the expert cache of {self.capacity_bytes / 2**20:.0f} MiB cannot hold the {self.min_experts} "
                f"experts one token uses ({self.expert_bytes / 2**20:.1f} MiB each); raise --memory-budget"
            )
        self._lru: OrderedDict[tuple[int, int], ExpertArrays] = OrderedDict()
        self._pending: dict[tuple[int, int], Future[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="twinfer-experts") if self.prefetch_enabled else None

    @property
    def max_experts(self) -> int:
        return self.capacity_bytes // self.expert_bytes

    @property
    def resident_bytes(self) -> int:
        return (len(self._lru) + len(self._pending)) * self.expert_bytes

    def cached(self) -> list[tuple[int, int]]:
        return list(self._lru)

    def fetch(self, layer: int, expert: int) -> ExpertArrays:
        """The expert's backend arrays, reading them (or waiting for a prefetch) when not cached."""
        key = (layer, expert)
        self.stats.lookups += 1
        hit = self._lru.get(key)
        if hit is not None:
            self._lru.move_to_end(key)
            self.stats.hits += 1
            return hit
        t0 = time.perf_counter()
        future = self._pending.pop(key, None)
        if future is not None:
            host = future.result()
            self.stats.prefetch_hits += 1
        else:
            self._make_room(1)
            host = self.reader.read(layer, expert)
            self.stats.bytes_read += self.reader.stored_bytes(layer, expert)
            self.stats.misses += 1
        arrays = self._insert(key, host)
        self.stats.stall_s += time.perf_counter() - t0
        return arrays

    def prefetch(self, layer: int, experts: Sequence[int]) -> None:
        """Start reading `layer`'s likely experts that are neither cached nor in flight."""
        if self._pool is None:
            return
        for e in experts:
            key = (layer, int(e))
            if key in self._lru or key in self._pending:
                continue
            if len(self._pending) >= self.min_experts or self.max_experts - self.min_experts <= len(self._pending):
                return  # keep room for the current layer's experts
            self._make_room(1)
            self._pending[key] = self._pool.submit(self.reader.read, layer, int(e))
            self.stats.bytes_read += self.reader.stored_bytes(layer, int(e))
            self.stats.prefetched += 1

    def settle(self, layer: int) -> None:
        """After `layer` ran: move its finished prefetches into the cache; reads in flight stay pending
        (waiting would stall the forward pass for experts it did not need)."""
        for key in [k for k, f in self._pending.items() if k[0] <= layer and f.done()]:
            self._insert(key, self._pending.pop(key).result())

    def drain(self) -> None:
        """Wait for every read in flight and move it into the cache."""
        for key in list(self._pending):
            self._insert(key, self._pending.pop(key).result())

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._pending.clear()
        self._lru.clear()

    def _insert(self, key: tuple[int, int], host: tuple[np.ndarray, ...]) -> ExpertArrays:
        self._make_room(0)
        gate, up, down = (self.to_device(a) for a in host)
        self._lru[key] = (gate, up, down)
        return gate, up, down

    def _make_room(self, incoming: int) -> None:
        """Evict least recently used experts until `incoming` more fit beside the cache and staging."""
        evicted = False
        while self._lru and len(self._lru) + len(self._pending) + incoming > self.max_experts:
            self._lru.popitem(last=False)
            self.stats.evictions += 1
            evicted = True
        if evicted and self.on_evict is not None:
            self.on_evict()


# -- choosing streaming and sizing the cache -----------------------------------------------------------
@dataclass(frozen=True)
class ExpertBudget:
    """How a memory budget splits between resident weights, the KV cache, staging and the expert cache."""

    budget: int
    resident_bytes: int  # non-expert weights as the backend holds them
    expert_bytes_total: int  # every routed expert as the backend would hold it
    kv_bytes: int
    reserve_bytes: int  # activations and one layer's read staging

    @property
    def cache_bytes(self) -> int:
        return self.budget - self.resident_bytes - self.kv_bytes - self.reserve_bytes


def plan_expert_budget(weights: WeightSet, budget: int, dtype_bytes: int, kv_tokens: int) -> ExpertBudget:
    """Split `budget` for streaming `weights`' experts with a backend holding `dtype_bytes` per value."""
    spec = weights.spec
    if spec.moe is None:
        raise ModelError(f"{spec.name or spec.model_type} has no experts to stream")
    resident = 0
    for name in weights.names():
        if is_expert_weight(name) or (name == "lm_head" and spec.tie_word_embeddings):
            continue
        resident += int(np.prod(weights.shape(name))) * dtype_bytes
    per_expert = expert_params(spec) * dtype_bytes
    n_experts = spec.moe.num_experts * sum(spec.is_moe_layer(i) for i in range(spec.num_layers))
    kv = int(kv_tokens * spec.kv_bytes_per_token(dtype_bytes))  # as the runner allocates it (MLA: the latent)
    # activations of one prefill chunk of 512 tokens, a few rows of logits, one layer's top_k experts mid-read
    act = 512 * (4 * spec.hidden_size + 3 * spec.moe.expert_intermediate_size) * 4 + spec.vocab_size * 16 * 4
    reserve = act + spec.moe.top_k * expert_params(spec) * 4
    return ExpertBudget(budget, resident, per_expert * n_experts, kv, reserve)



class StreamingOps:
    """Wraps a backend's Ops: everything is delegated except `moe` on `ExpertHandle` weights.

    Routing is the resident path's (softmax or sigmoid with group-limited top-k, router and score
    biases, routed scaling); each expert runs with its biases and, where the spec says so, gpt-oss's
    clamped SwiGLU. Backends subclass it with the array math (`_route`, `_predict`, `_expert_out`).
    """

    def __init__(self, inner: Any, cache: ExpertCache, routers: dict[int, Any], spec: ModelSpec):
        self.inner = inner
        self.cache = cache
        self.routers = routers  # layer -> router weight on the backend (for prefetch prediction)
        self.spec = spec

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def begin_step(self, batch: Any) -> Any:
        self.cache.stats.tokens += batch.num_tokens
        return self.inner.begin_step(batch)

    def moe(self, x: Any, router: Any, gate: Any, up: Any, down: Any, moe: Any, act: str, extras: Any = None) -> Any:
        if not isinstance(gate, ExpertHandle):
            return self.inner.moe(x, router, gate, up, down, moe, act, extras)
        layer = gate.layer
        weights, experts = self._route(x, router, moe, extras)  # device [T, k], host int [T, k]
        nxt = self.routers.get(layer + 1)
        if nxt is not None and self.cache.prefetch_enabled:
            self.cache.prefetch(layer + 1, self._predict(x, nxt, moe.top_k))
        out = None
        for e in sorted(set(experts.flatten().tolist())):  # ascending, as the resident dispatch runs
            tok, slot = np.nonzero(experts == e)
            g, u, d = self.cache.fetch(layer, e)
            out = self._expert_out(out, x, Routed(e, tok, slot, weights), (g, u, d), moe, act, extras)
        self.cache.settle(layer)
        return out

    # -- backend math ------------------------------------------------------------------------------
    def _route(self, x: Any, router: Any, moe: Any, extras: Any) -> tuple[Any, np.ndarray]:
        """Top-k routing exactly as the backend's resident `moe`: (weights on device, expert ids on host)."""
        raise NotImplementedError

    def _predict(self, x: Any, router: Any, k: int) -> list[int]:
        """The experts `router` would pick for the rows of x, most likely first."""
        raise NotImplementedError

    def _expert_out(self, out: Any, x: Any, routed: Routed, arrays: ExpertArrays, moe: Any, act: str,
                    extras: Any) -> Any:
        """out (None at first) + weights[tok, slot] * expert(x[tok]) scattered to rows `tok` (all of
        `routed`); `routed.expert` indexes the resident per-expert biases in `extras`."""
        raise NotImplementedError
