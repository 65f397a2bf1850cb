"""The MLX runner's KV for a KV connector, in `PagedKVPort`'s payload layout (a linear-attention layer's:
the sequence's conv and delta state); a load builds a new cache array (MLX arrays are immutable),
evaluated at once."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from twinfer.backends.metal.ops import MlxOps
from twinfer.runtime.kv.connector import PagedKVPort

# numpy has no bfloat16: bytes leave and enter through an unsigned view of the element's width
_RAW = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32}


class MlxKVPort(PagedKVPort):
    """`runtime.kv.connector.KVPort` over an `MlxOps` paged cache (dense K/V; TurboQuant codes are refused)."""

    backend = "mlx"
    ops: MlxOps

    def _slots(self, table: list[int], num_tokens: int) -> mx.array:
        return mx.array(self.positions(table, num_tokens).astype(np.int32))

    def save_layer(self, layer: int, seq_id: int, table: list[int], num_tokens: int) -> bytes:
        self.check()
        states = self.ops.states
        if states is not None and layer in states.conv:  # a linear-attention layer: no KV, the state
            return b"".join(np.array(a.view(_RAW[a.itemsize])).tobytes() if a.size else b""
                            for a in states.state(layer, seq_id, num_tokens))
        slots = self._slots(table, num_tokens)
        out = b""
        for cache in (self.ops.k_cache[layer], self.ops.v_cache[layer]):
            if cache.shape[0]:
                rows = mx.take(cache, slots, axis=0).view(_RAW[cache.itemsize])
                out += np.array(rows).tobytes()
        return out

    def load_layer(self, layer: int, seq_id: int, table: list[int], num_tokens: int, data: bytes) -> None:
        self.check()
        states = self.ops.states
        if states is not None and layer in states.conv:
            pools = (states.conv[layer], states.delta[layer])
            sizes = [p[0].size * p.itemsize for p in pools]
            self.check_size(layer, data, sizes, num_tokens)
            conv, delta = (_array(data, at, size, p.dtype, p.shape[1:])
                           for p, size, at in zip(pools, sizes, (0, sizes[0]), strict=True))
            states.put_state(layer, seq_id, num_tokens, conv, delta)
            return
        slots = self._slots(table, num_tokens)
        caches = [self.ops.k_cache[layer], self.ops.v_cache[layer]]
        sizes = [num_tokens * (c.size // c.shape[0]) * c.itemsize if c.shape[0] else 0 for c in caches]
        self.check_size(layer, data, sizes, num_tokens)
        at = 0
        for i, (cache, size) in enumerate(zip(caches, sizes, strict=True)):
            if not size:
                continue
            cache[slots] = _array(data, at, size, cache.dtype, (num_tokens, *cache.shape[1:]))  # a scatter: a new array
            caches[i] = cache
            at += size
        self.ops.k_cache[layer], self.ops.v_cache[layer] = caches
        mx.eval(caches)


def _array(data: bytes, at: int, size: int, dtype: mx.Dtype, shape: tuple[int, ...] | list[int]) -> mx.array:
    """`size` bytes of `data` from `at` as an array of `dtype` and `shape` (through numpy's unsigned view)."""
    if not size:  # a conv kernel of 1 keeps no conv state
        return mx.zeros(tuple(shape), dtype=dtype)
    raw = np.frombuffer(data, dtype=np.uint8, count=size, offset=at)
    return mx.array(raw.view(f"<u{dtype.size}")).view(dtype).reshape(*shape)
