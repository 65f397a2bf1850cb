"""The torch runner's KV for a KV connector: each layer's K and V at a sequence's positions, as bytes
(the payload layout of `runtime.kv.connector.PagedKVPort`)."""

from __future__ import annotations

import torch

from twinfer.backends.cuda.ops import TorchOps
from twinfer.runtime.kv.connector import PagedKVPort


class TorchKVPort(PagedKVPort):
    """`runtime.kv.connector.KVPort` over a `TorchOps` paged cache (dense K/V; TurboQuant codes are refused)."""

    backend = "torch"
    ops: TorchOps

    def _slots(self, table: list[int], num_tokens: int) -> torch.Tensor:
        return torch.from_numpy(self.positions(table, num_tokens)).to(self.ops.device)

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
        self.check_size(layer, data, sizes, num_tokens)
        at = 0
        for cache, size in zip(caches, sizes, strict=True):
            if not size:
                continue
            raw = torch.frombuffer(bytearray(data[at : at + size]), dtype=torch.uint8)
            values = raw.view(cache.dtype).reshape(num_tokens, *cache.shape[1:]).to(cache.device)
            cache.index_copy_(0, slots, values)
            at += size
