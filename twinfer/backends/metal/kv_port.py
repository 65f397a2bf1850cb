"""The MLX runner's KV for a KV connector: each layer's K and V at a sequence's positions, as bytes.

The layout of the torch port (backends/cuda/kv_port.py): a layer's payload is K then V of positions
[0, num_tokens) in position order ([n, Hkv, D] each; MLA: the latent only), independent of either
replica's block size or block ids. MLX arrays are immutable: a load scatters into a new cache array
that replaces the layer's, evaluated at once so the next step reads it.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from twinfer.backends.metal.ops import MlxOps

# numpy has no bfloat16: bytes leave and enter through an unsigned view of the element's width
_RAW = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32}


class MlxKVPort:
    """`runtime.kv.connector.KVPort` over an `MlxOps` paged cache (dense K/V; TurboQuant codes are refused)."""

    def __init__(self, ops: MlxOps):
        self.ops = ops
        spec = ops.spec
        self.format = (f"mlx:{spec.name}:{ops.dtype}:{spec.num_layers}x{spec.num_kv_heads}x{spec.head_dim}"
                       f":{'mla' if spec.mla is not None else 'mha'}")

    def num_layers(self) -> int:
        return self.ops.spec.num_layers

    def kv_bytes(self, layer: int, data: bytes) -> int:
        return len(data)  # K and V rows alone, no framing

    def _slots(self, table: list[int], num_tokens: int) -> mx.array:
        bs = self.ops.block_size
        if len(table) * bs < num_tokens:
            raise ValueError(f"{len(table)} KV blocks cannot hold {num_tokens} positions")
        pos = np.arange(num_tokens)
        return mx.array((np.asarray(table, dtype=np.int64)[pos // bs] * bs + pos % bs).astype(np.int32))

    def check(self) -> None:
        if self.ops.kv_quant:
            raise ValueError("a TurboQuant-coded KV cache cannot be handed to another replica; serve with dense KV")

    def save_layer(self, layer: int, seq_id: int, table: list[int], num_tokens: int) -> bytes:
        self.check()
        slots = self._slots(table, num_tokens)
        out = b""
        for cache in (self.ops.k_cache[layer], self.ops.v_cache[layer]):
            if cache.shape[0]:
                rows = mx.take(cache, slots, axis=0).view(_RAW[cache.itemsize])
                out += np.array(rows).tobytes()
        return out

    def load_layer(self, layer: int, seq_id: int, table: list[int], num_tokens: int, data: bytes) -> None:
        self.check()
        slots = self._slots(table, num_tokens)
        caches = [self.ops.k_cache[layer], self.ops.v_cache[layer]]
        sizes = [num_tokens * (c.size // c.shape[0]) * c.itemsize if c.shape[0] else 0 for c in caches]
        if sum(sizes) != len(data):
            raise ValueError(f"layer {layer}: {len(data)} bytes of KV, expected {sum(sizes)} for {num_tokens} positions")
        at = 0
        for i, (cache, size) in enumerate(zip(caches, sizes, strict=True)):
            if not size:
                continue
            raw = np.frombuffer(data, dtype=np.uint8, count=size, offset=at)
            values = mx.array(raw.view(f"<u{cache.itemsize}")).view(cache.dtype).reshape(num_tokens, *cache.shape[1:])
            cache[slots] = values  # a scatter: builds the next cache array
            caches[i] = cache
            at += size
        self.ops.k_cache[layer], self.ops.v_cache[layer] = caches
        mx.eval(caches)
