"""KV block accounting with keyed full-block prefix reuse (vLLM-style automatic prefix caching); keys are
SHA-256 chained over parent and tokens, and every hit is checked against the stored tokens."""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from twinfer.runtime.kv.events import KVEventSink

Link = tuple[int, int]  # (block id, generation): one registered block's content, stable while cached


def root_key(salt: bytes = b"") -> bytes:
    """The parent key of every first block; `salt` names whatever else the KV depends on."""
    return hashlib.sha256(b"twinfer-prefix-cache\0" + salt).digest()


def block_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """Key of a full block: SHA-256 over its parent's key and its token ids (int64, little-endian)."""
    ids = array("q", tokens)
    if sys.byteorder == "big":  # pragma: no cover - the same key on every machine
        ids.byteswap()
    return hashlib.sha256(parent + ids.tobytes()).digest()


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    key: bytes | None = None  # set once the block is full and registered in the prefix cache
    tokens: tuple[int, ...] | None = None  # the registered block's token ids, checked on every hit
    parent: Link | None = None  # the registered block's parent block (None: first block)
    generation: int = 0  # bumped whenever the block stops holding its registered content


@dataclass
class SeqBlocks:
    """The blocks one sequence holds, and the key and content link of each of its full blocks."""

    table: list[int] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)  # key of each full block in `table`
    links: list[Link] = field(default_factory=list)  # the registered block holding each full block's content


class OutOfBlocks(Exception):
    """Not enough free blocks; the scheduler preempts or waits. Never reaches a user."""


class BlockManager:
    """Allocates KV blocks to sequences. Called by the scheduler, one thread. Every block is free, cached
    (ref 0, keyed, in the LRU) or in use, at most once per table (`check()` asserts it in tests)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = True, salt: bytes = b""):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() gives low ids first
        self.cached: OrderedDict[int, None] = OrderedDict()  # block ids with ref 0 and a key, LRU first
        self.by_key: dict[bytes, int] = {}
        self.root = root_key(salt)
        self.seqs: dict[int, SeqBlocks] = {}
        self.on_evict: Callable[[int], None] | None = None  # told each cached block id evicted for room
        self.events: KVEventSink | None = None  # told each block registered / unregistered (runtime/kv/events.py)
        self.hits = 0  # prefix-cache tokens reused
        self.queries = 0  # prompt tokens looked up

    @property
    def num_free(self) -> int:
        """Blocks available without preempting anyone (free + evictable cached)."""
        return len(self.free_ids) + len(self.cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, tokens: Sequence[int]) -> list[int]:
        """Block ids of the longest cached full-block prefix of `tokens` (not yet referenced).
        At least one token is always left uncached, so the request still computes logits."""
        if not self.enable_prefix_cache:
            return []
        found: list[int] = []
        key, link = self.root, None
        bs = self.block_size
        for start in range(0, len(tokens) - 1 - (len(tokens) - 1) % bs, bs):
            chunk = tuple(tokens[start : start + bs])
            key = block_key(key, chunk)
            block_id = self.by_key.get(key)
            if block_id is None or not self._holds(block_id, chunk, link):
                break  # a miss, or a key that collides with other content: never reuse it
            found.append(block_id)
            link = (block_id, self.blocks[block_id].generation)
        return found

    def allocate(self, seq_id: int, prefix: Sequence[int], num_tokens: int, tokens: Sequence[int]) -> None:
        """Give `seq_id` blocks for positions [0, num_tokens), reusing `prefix` first; blocks register for
        reuse once computed (`mark_computed`). Raises OutOfBlocks, changing nothing, when it cannot."""
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
                block = self.blocks[block_id]
                seq.keys.append(block.key)  # type: ignore[arg-type]
                seq.links.append((block_id, block.generation))
        for _ in range(need):
            seq.table.append(self._take())

    def register_full_blocks(self, seq_id: int, tokens: Sequence[int]) -> None:
        """Key the sequence's newly full blocks whose tokens are all computed, for reuse by others."""
        if not self.enable_prefix_cache:
            return
        seq = self.seqs[seq_id]
        bs = self.block_size
        while len(seq.keys) < min(len(seq.table), len(tokens) // bs):
            i = len(seq.keys)
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            key = block_key(seq.keys[-1] if seq.keys else self.root, chunk)
            parent = seq.links[-1] if seq.links else None
            block = self.blocks[seq.table[i]]
            existing = self.by_key.get(key)
            holder = block.block_id
            if existing is None and block.key is None:
                block.key, block.tokens, block.parent = key, chunk, parent
                self.by_key[key] = holder
                if self.events is not None:
                    self.events.stored(key, seq.keys[-1] if seq.keys else None, chunk)
            elif existing is not None and self._holds(existing, chunk, parent):
                holder = existing  # the same content is already registered: link children to it
            seq.keys.append(key)
            seq.links.append((holder, self.blocks[holder].generation))

    def mark_computed(self, seq_id: int, tokens: Sequence[int], num_computed: int) -> None:
        """Record that the first `num_computed` tokens are in KV: register their full blocks."""
        self.register_full_blocks(seq_id, tokens[:num_computed])

    def free(self, seq_id: int) -> None:
        """Drop a sequence's references; its registered blocks stay cached for reuse, the rest are freed."""
        seq = self.seqs.pop(seq_id, None)
        if seq is None:
            return
        for block_id in reversed(seq.table):  # tail first, so the LRU evicts tails before heads
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                if self.is_registered(block_id):
                    self.cached[block_id] = None
                else:
                    self._release(block)

    def table(self, seq_id: int) -> list[int]:
        return self.seqs[seq_id].table

    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def is_registered(self, block_id: int) -> bool:
        """Whether the block is the prefix cache's entry for its content (reusable by others)."""
        key = self.blocks[block_id].key
        return key is not None and self.by_key.get(key) == block_id

    def _holds(self, block_id: int, tokens: tuple[int, ...], parent: Link | None) -> bool:
        """Whether a registered block holds exactly `tokens` after exactly `parent`'s content."""
        block = self.blocks[block_id]
        return block.tokens == tokens and block.parent == parent

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
            self._unregister(self.blocks[block_id])
            if self.on_evict is not None:
                self.on_evict(block_id)
        self.blocks[block_id].ref_count = 1
        return block_id

    def _unregister(self, block: Block) -> None:
        """The block stops holding its registered content: drop its key; its children no longer link."""
        if block.key is not None and self.by_key.get(block.key) == block.block_id:
            del self.by_key[block.key]
            if self.events is not None:
                self.events.removed(block.key)
        block.key = block.tokens = block.parent = None
        block.generation += 1

    def _release(self, block: Block) -> None:
        self._unregister(block)
        self.free_ids.append(block.block_id)

    def uncache(self, block_ids: Sequence[int]) -> None:
        """The runner no longer holds these blocks' KV: those only cached (unreferenced) are freed."""
        for block_id in block_ids:
            if block_id in self.cached:
                del self.cached[block_id]
                self._release(self.blocks[block_id])

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
