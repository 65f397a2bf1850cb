"""How llama.cpp's per-sequence KV follows the engine's block accounting (`KVSync` for `LlamaCppRunner`):
a cached block is reusable only while some live or kept sequence's slot holds it (docs/architecture.md,
"The runner contract")."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

from twinfer.runtime.kv.block_manager import BlockManager
from twinfer.runtime.runner import KVSync

if TYPE_CHECKING:
    from twinfer.backends.llamacpp.runner import LlamaCppRunner


class SlotKVSync(KVSync):
    """The llama.cpp runner's side of one engine's KV accounting. Called from the engine's thread."""

    def __init__(self, runner: LlamaCppRunner, blocks: BlockManager, slots: int, running: Callable[[], int]):
        self.runner = runner
        self.blocks = blocks
        self.slots = slots  # sequences that may hold a llama.cpp slot at once: running + retained
        self.running = running
        self.owner: dict[int, int] = {}  # block id -> the sequence whose slot holds its KV
        self.retained: OrderedDict[int, None] = OrderedDict()  # finished sequences kept for their prefix
        self.evicted: set[int] = set()  # owners of blocks evicted since the last step
        self.claimed: set[int] = set()  # kept sequences a request of this step may take over (no slot free)
        blocks.on_evict = self._on_evict

    def reusable(self, block_ids: list[int]) -> int:
        """Only a prefix some sequence still holds. With no slot free for a copy, one request a step takes
        over a kept source's slot, as llama-server hands a new request the slot holding its prompt."""
        while block_ids and self.owner.get(block_ids[-1]) is None:
            block_ids = block_ids[:-1]
        owner = self.owner.get(block_ids[-1]) if block_ids else None
        if owner is not None and owner in self.retained and self.running() + 2 > self.slots:
            if owner in self.claimed:
                return 0
            self.claimed.add(owner)
        return len(block_ids)

    def begin_step(self, preempted: list[int], admitted: list[tuple[int, int]]) -> None:
        """Drop preempted and evicted sequences, copy cached prefixes into admitted ones, keep slots."""
        for seq_id in preempted:
            self.dropped(seq_id)
        evicted, self.evicted = self.evicted, set()
        for seq_id in evicted & set(self.retained):
            self.drop_kept(seq_id)
        copies = []
        for seq_id, prefix_blocks in admitted:
            if prefix_blocks:
                src = self.owner.get(self.blocks.table(seq_id)[prefix_blocks - 1])
                if src is not None and src != seq_id:
                    copies.append((src, seq_id, prefix_blocks * self.blocks.block_size))
        self.claimed.clear()
        last = {src: i for i, (src, _, _) in enumerate(copies)}
        self._trim_retained(keep={src for src, _, _ in copies})
        for i, (src, dst, n) in enumerate(copies):
            if src in self.retained and last[src] == i and self.running() + len(self.retained) > self.slots:
                self._adopt(src, dst, n)
            else:
                self.runner.copy_prefix(src, dst, n)
            self._trim_retained(keep={later for later, _, _ in copies[i + 1 :]})

    def computed(self, seq_id: int, num_computed: int) -> None:
        for block_id in self.blocks.table(seq_id)[: num_computed // self.blocks.block_size]:
            self.owner[block_id] = seq_id

    def finished(self, seq_id: int, table: list[int]) -> None:
        """Keep the sequence's leading cached blocks in its slot for prefix reuse; drop the rest."""
        keep = 0
        for block_id in table:
            if not self.blocks.is_registered(block_id):
                break
            keep += 1
        self._disown(seq_id, table[keep:])
        if keep:
            self.runner.truncate(seq_id, keep * self.blocks.block_size)
            self.retained[seq_id] = None
        else:
            self.runner.release(seq_id)

    def dropped(self, seq_id: int) -> None:
        """The slot's KV is gone, so the blocks it held can no longer be reused."""
        self._evict_owner(seq_id)
        self.runner.release(seq_id)

    def isolate(self) -> None:
        """Cells kept before the new sequence's make its KV start mid-tile in the view llama.cpp's
        tiled flash attention walks (chunks of >= 64 rows), which changes their logits: give them
        back, so its cells start at 0 as on a fresh runner."""
        self.close()

    def close(self) -> None:
        for seq_id in list(self.retained):
            self.drop_kept(seq_id)

    def _on_evict(self, block_id: int) -> None:
        owner = self.owner.pop(block_id, None)
        if owner is not None:
            self.evicted.add(owner)

    def _trim_retained(self, keep: set[int]) -> None:
        """Drop the oldest kept sequences (not in `keep`) until running + kept fit the slots."""
        over = self.running() + len(self.retained) - self.slots
        for seq_id in list(self.retained):
            if over <= 0:
                break
            if seq_id not in keep:
                self.drop_kept(seq_id)
                over -= 1

    def _adopt(self, src: int, dst: int, num_tokens: int) -> None:
        """The kept `src`'s slot becomes `dst`'s, cut to its first `num_tokens` positions."""
        del self.retained[src]
        kept = set(self.blocks.table(dst)[: num_tokens // self.blocks.block_size])
        self._disown(src, [b for b, owner in self.owner.items() if owner == src and b not in kept])
        for block_id in kept:
            self.owner[block_id] = dst
        self.runner.adopt_prefix(src, dst, num_tokens)

    def drop_kept(self, seq_id: int) -> None:
        """Give a kept sequence's slot back (its cached blocks go with it)."""
        self.retained.pop(seq_id, None)
        self.dropped(seq_id)

    def _evict_owner(self, seq_id: int) -> None:
        """Forget what the sequence's slot held; blocks only it kept cached are freed."""
        held = [b for b, owner in self.owner.items() if owner == seq_id]
        for block_id in held:
            del self.owner[block_id]
        self.blocks.uncache(held)

    def _disown(self, seq_id: int, block_ids: list[int]) -> None:
        """The slot no longer holds these blocks (it is truncated before them)."""
        mine = [b for b in block_ids if self.owner.get(b) == seq_id]
        for block_id in mine:
            del self.owner[block_id]
        self.blocks.uncache(mine)
