"""The torch runner's KV for a KV connector: each layer's K and V at a sequence's positions, as bytes.

A layer's payload is K then V of positions [0, num_tokens), in position order ([n, Hkv, D] each; MLA:
the latent only), so it is independent of either replica's block size or block ids.
"""

from __future__ import annotations

import torch

from twinfer.backends.cuda.ops import TorchOps


class TorchKVPort:
    """`runtime.kv.connector.KVPort` over a `TorchOps` paged cache (dense K/V; TurboQuant codes are refused)."""

    def __init__(self, ops: TorchOps):
        self.ops = ops
        spec = ops.spec
        self.format = (f"torch:{spec.name}:{ops.dtype}:{spec.num_layers}x{spec.num_kv_heads}x{spec.head_dim}"
                       f":{'mla' if spec.mla is not None else 'mha'}")

    def num_layers(self) -> int:
        return self.ops.spec.num_layers

    def kv_bytes(self, layer: int, data: bytes) -> int:
        return len(data)  # K and V rows alone, no framing

    def _slots(self, table: list[int], num_tokens: int) -> torch.Tensor:
        bs = self.ops.block_size
        if len(table) * bs < num_tokens:
            raise ValueError(f"{len(table)} KV blocks cannot hold {num_tokens} positions")
        pos = torch.arange(num_tokens)
        blocks = torch.as_tensor(table, dtype=torch.int64)[pos // bs]
        return (blocks * bs + pos % bs).to(self.ops.device)

    def check(self) -> None:
        if self.ops.kv_quant:
            raise ValueError("a TurboQuant-coded KV cache cannot be handed to another replica; serve with dense KV")

    def save_layer(self, layer: int, seq_id: int, table: list[int], num_tokens: int) -> bytes:
        self.check()
        slots = self._slots(table, num_tokens)
        parts = [c[layer].index_select(0, slots) for c in (self.ops.k_cache, self.ops.v_cache)]
        return b"".join(p.contiguous().cpu().view(torch.uint8).numpy().tobytes() for p in parts)

    def load_layer(self, layer: int, seq_id: int, table: list[int], num_tokens: int, data: bytes) -> None:
        self.check()
        slots = self._slots(table, num_tokens)
        caches = (self.ops.k_cache[layer], self.ops.v_cache[layer])
        sizes = [num_tokens * c[0].numel() * c.element_size() if c.shape[0] else 0 for c in caches]
        if sum(sizes) != len(data):
            raise ValueError(f"layer {layer}: {len(data)} bytes of KV, expected {sum(sizes)} for {num_tokens} positions")
        at = 0
        for cache, size in zip(caches, sizes, strict=True):
            if not size:
                continue
            raw = torch.frombuffer(bytearray(data[at : at + size]), dtype=torch.uint8)
            values = raw.view(cache.dtype).reshape(num_tokens, *cache.shape[1:]).to(cache.device)
            cache.index_copy_(0, slots, values)
            at += size
