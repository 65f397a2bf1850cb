"""The torch runner's KV for a KV connector: each layer's K and V at a sequence's positions, as bytes
(the payload layout of `runtime.kv.connector.PagedKVPort`); a linear-attention layer's payload is the
sequence's conv and delta state after those positions."""

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
        states = self.ops.states
        if states is not None and layer in states.conv:  # a linear-attention layer: no KV, the state
            parts: list[torch.Tensor] = list(states.state(layer, seq_id, num_tokens))
        else:
            slots = self._slots(table, num_tokens)
            parts = [c[layer].index_select(0, slots) for c in (self.ops.k_cache, self.ops.v_cache)]
        return b"".join(p.contiguous().cpu().view(torch.uint8).numpy().tobytes() for p in parts)

    def load_layer(self, layer: int, seq_id: int, table: list[int], num_tokens: int, data: bytes) -> None:
        self.check()
        states = self.ops.states
        if states is not None and layer in states.conv:
            pools = (states.conv[layer], states.delta[layer])
            sizes = [p[0].numel() * p.element_size() for p in pools]
            self.check_size(layer, data, sizes, num_tokens)
            conv, delta = (_tensor(data[at : at + size], p.dtype, p.shape[1:], p.device)
                           for p, size, at in zip(pools, sizes, (0, sizes[0]), strict=True))
            states.put_state(layer, seq_id, num_tokens, conv, delta)
            return
        slots = self._slots(table, num_tokens)
        caches = (self.ops.k_cache[layer], self.ops.v_cache[layer])
        sizes = [num_tokens * c[0].numel() * c.element_size() if c.shape[0] else 0 for c in caches]
        self.check_size(layer, data, sizes, num_tokens)
        at = 0
        for cache, size in zip(caches, sizes, strict=True):
            if not size:
                continue
            cache.index_copy_(0, slots, _tensor(data[at : at + size], cache.dtype, (num_tokens, *cache.shape[1:]),
                                                cache.device))
            at += size


def _tensor(data: bytes, dtype: torch.dtype, shape: tuple[int, ...] | torch.Size, device: torch.device) -> torch.Tensor:
    if not data:  # torch.frombuffer refuses an empty buffer (a conv kernel of 1 keeps no conv state)
        return torch.empty(shape, dtype=dtype, device=device)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape).to(device)
