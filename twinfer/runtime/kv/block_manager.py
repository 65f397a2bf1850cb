"""KV block accounting with hashed full-block prefix reuse (vLLM-style automatic prefix caching).

A sequence's KV lives in fixed-size blocks. A block that is full gets a hash chained from its
parent's hash and its tokens, so two sequences with the same first N*block_size tokens share the
same N blocks. Blocks are reference-counted; a block nobody references stays cached (and reusable)
until it is evicted least-recently-used to make room.

The manager never touches a device. For sequence-slot runners (llama.cpp) a cached block also
records the sequence that physically holds it (`owner`), so the engine can copy that prefix or
release that sequence when its blocks are evicted.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

_ROOT = 0x9E3779B97F4A7C15


def block_hash(parent: int | None, tokens: Sequence[int]) -> int:
    """Hash of a full block, chained from its parent's hash (None for the first block)."""
    return hash((_ROOT if parent is None else parent, tuple(tokens)))


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set once the block is full and registered in the prefix cache
    owner: int | None = None  # sequence id that physically holds this block (sequence-slot runners)


@dataclass
class SeqBlocks:
    """The blocks one sequence holds, and the hash of its last full block."""

    table: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)  # hash of each full block in `table`


class OutOfBlocks(Exception):
    """Not enough free blocks; the scheduler preempts or waits. Never reaches a user."""


class BlockManager:
    """Allocates KV blocks to sequences. Called by the scheduler, one thread.

    Invariants (checked by `check()` in tests): every block is either free (ref 0, no hash),
    cached (ref 0, hashed, in the LRU) or in use (ref > 0); a block id appears at most once per table;
    free + cached + in-use = num_blocks.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = True):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() gives low ids first
        self.cached: OrderedDict[int, None] = OrderedDict()  # block ids with ref 0 and a hash, LRU first
        self.by_hash: dict[int, int] = {}
        self.seqs: dict[int, SeqBlocks] = {}
        self.evicted_owners: list[int] = []  # owners whose cached blocks were evicted (engine drains)
        self.hits = 0  # prefix-cache tokens reused
        self.queries = 0  # prompt tokens looked up

    # -- capacity ------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks available without preempting anyone (free + evictable cached)."""
        return len(self.free_ids) + len(self.cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix lookup ---------------------------------------------------------------------------
    def match_prefix(self, tokens: Sequence[int]) -> list[int]:
        """Block ids of the longest cached full-block prefix of `tokens` (not yet referenced).

        At least one token is always left uncached, so the request still computes logits.
        """
        if not self.enable_prefix_cache:
            return []
        found: list[int] = []
        parent: int | None = None
        bs = self.block_size
        for start in range(0, len(tokens) - 1 - (len(tokens) - 1) % bs, bs):
            h = block_hash(parent, tokens[start : start + bs])
            block_id = self.by_hash.get(h)
            if block_id is None:
                break
            found.append(block_id)
            parent = h
        return found

    def owner_of(self, block_id: int) -> int | None:
        return self.blocks[block_id].owner

    # -- allocation ------------------------------------------------------------------------------
    def allocate(self, seq_id: int, prefix: Sequence[int], num_tokens: int, tokens: Sequence[int]) -> None:
        """Give `seq_id` blocks for positions [0, num_tokens), reusing the `prefix` block ids first.

        `tokens` are the sequence's known tokens (prompt + output), counted for the hit rate; blocks
        are registered for reuse only once computed (`mark_computed`). Raises OutOfBlocks (and changes nothing) when it cannot.
        """
        seq = self.seqs.get(seq_id)
        held = len(seq.table) if seq is not None else len(prefix)
        need = self.blocks_for(num_tokens) - held
        revived = 0 if seq is not None else sum(1 for b in prefix if self.blocks[b].ref_count == 0)
        if need > self.num_free - revived:
            raise OutOfBlocks(f"sequence {seq_id} needs {need} blocks, {self.num_free - revived} free")
        if seq is None:
            seq = self.seqs[seq_id] = SeqBlocks()
            self.queries += len(tokens)
            self.hits += len(prefix) * self.block_size
            for block_id in prefix:
                self._ref(block_id)
                seq.table.append(block_id)
                seq.hashes.append(self.blocks[block_id].hash)  # type: ignore[arg-type]
        for _ in range(need):
            seq.table.append(self._take())

    def register_full_blocks(self, seq_id: int, tokens: Sequence[int]) -> None:
        """Hash the sequence's newly full blocks whose tokens are all computed, for reuse by others."""
        if not self.enable_prefix_cache:
            return
        seq = self.seqs[seq_id]
        bs = self.block_size
        while len(seq.hashes) < min(len(seq.table), len(tokens) // bs):
            i = len(seq.hashes)
            parent = seq.hashes[-1] if seq.hashes else None
            h = block_hash(parent, tokens[i * bs : (i + 1) * bs])
            block = self.blocks[seq.table[i]]
            existing = self.by_hash.get(h)
            if existing is None and block.hash is None:
                block.hash = h
                self.by_hash[h] = block.block_id
            seq.hashes.append(h)

    def mark_computed(self, seq_id: int, tokens: Sequence[int], num_computed: int, owner: int | None) -> None:
        """Record that the first `num_computed` tokens are in KV: register their full blocks."""
        self.register_full_blocks(seq_id, tokens[:num_computed])
        if owner is not None:
            seq = self.seqs[seq_id]
            for block_id in seq.table[: num_computed // self.block_size]:
                self.blocks[block_id].owner = owner

    def free(self, seq_id: int) -> None:
        """Drop a sequence's references; its hashed blocks stay cached for reuse, the rest are freed."""
        seq = self.seqs.pop(seq_id, None)
        if seq is None:
            return
        for block_id in reversed(seq.table):  # tail first, so the LRU evicts tails before heads
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                if block.hash is not None and self.by_hash.get(block.hash) == block_id:
                    self.cached[block_id] = None
                else:
                    self._release(block)

    def table(self, seq_id: int) -> list[int]:
        return self.seqs[seq_id].table

    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    # -- internals -------------------------------------------------------------------------------
    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self.cached.pop(block_id, None)
        block.ref_count += 1

    def _take(self) -> int:
        if self.free_ids:
            block_id = self.free_ids.pop()
        else:
            block_id, _ = self.cached.popitem(last=False)  # least recently used
            block = self.blocks[block_id]
            if block.owner is not None:
                self.evicted_owners.append(block.owner)
            self.by_hash.pop(block.hash, None)  # type: ignore[arg-type]
            block.hash = None
        block = self.blocks[block_id]
        block.ref_count = 1
        block.owner = None
        return block_id

    def _release(self, block: Block) -> None:
        if block.hash is not None and self.by_hash.get(block.hash) == block.block_id:
            del self.by_hash[block.hash]
        block.hash = None
        block.owner = None
        self.free_ids.append(block.block_id)

    def evict_owner(self, owner: int) -> None:
        """Evict every cached block physically held by `owner` (its sequence slot is being reused)."""
        for block_id in [b for b in self.cached if self.blocks[b].owner == owner]:
            del self.cached[block_id]
            self._release(self.blocks[block_id])
        for block in self.blocks:
            if block.owner == owner:
                block.owner = None

    def disown(self, owner: int, block_ids: list[int]) -> None:
        """`owner` no longer holds these blocks: clear its ownership and drop them if only cached."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.owner == owner:
                block.owner = None
                if block_id in self.cached:
                    del self.cached[block_id]
                    self._release(block)

    def check(self) -> None:
        """Assert the invariants (tests call this after every step)."""
        refs = [0] * self.num_blocks
        for seq in self.seqs.values():
            assert len(set(seq.table)) == len(seq.table), "a block appears twice in one table"
            for block_id in seq.table:
                refs[block_id] += 1
        for block in self.blocks:
            assert block.ref_count == refs[block.block_id], f"block {block.block_id} ref count mismatch"
        free, cached = set(self.free_ids), set(self.cached)
        assert len(free) == len(self.free_ids), "a block is free twice"
        assert not free & cached, "a block is both free and cached"
        in_use = {b.block_id for b in self.blocks if b.ref_count > 0}
        assert not in_use & (free | cached), "an in-use block is also free or cached"
        assert len(free) + len(cached) + len(in_use) == self.num_blocks, "blocks leaked"
