"""The llama.cpp runner's KV for a KV connector: a sequence's cells as llama.cpp serializes them.

`llama_state_seq_get_data` writes every cache layer's K and V of the sequence (plus its cells'
positions), so the payload is one "layer"; `llama_state_seq_set_data` puts it into a free slot.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from twinfer.backends.llamacpp.runner import LlamaCppRunner


class LlamaCppKVPort:
    """`runtime.kv.connector.KVPort` over `LlamaCppRunner`'s sequence state (one layer: the whole state)."""

    def __init__(self, runner: LlamaCppRunner):
        self.runner = runner
        spec = runner.spec
        self.format = (f"llamacpp:{spec.name}:{runner.path.stat().st_size}:{runner.kv_type}:"
                       f"{'unified' if runner.unified_kv else 'streams'}")

    def num_layers(self) -> int:
        return 1

    def save_layer(self, layer: int, seq_id: int, table: list[int], num_tokens: int) -> bytes:
        held = self.runner.num_stored(seq_id)
        if held < num_tokens:
            raise ValueError(f"sequence {seq_id} holds {held} positions, not the {num_tokens} to hand over")
        if held > num_tokens:
            self.runner.truncate(seq_id, num_tokens)
        return self.runner.save_seq_state(seq_id)

    def load_layer(self, layer: int, seq_id: int, table: list[int], num_tokens: int, data: bytes) -> None:
        held = self.runner.load_seq_state(seq_id, data)
        if held != num_tokens:
            self.runner.release(seq_id)
            raise ValueError(f"the KV state holds {held} positions, expected {num_tokens}")
