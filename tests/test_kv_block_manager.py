"""Block accounting and the prefix cache's keys: chained SHA-256, and hits checked against content.

The keys are cryptographic, so real collisions do not happen; the tests here make them happen on
purpose (a monkeypatched key function) and check that a hit is still never another prefix's KV.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from twinfer.runtime.kv import block_manager
from twinfer.runtime.kv.block_manager import BlockManager, block_key, root_key

BS = 4


def _computed(bm: BlockManager, seq_id: int, tokens: list[int]) -> None:
    """Allocate a fresh sequence for all of `tokens` (reusing its cached prefix) and compute it."""
    prefix = bm.match_prefix(tokens)
    bm.allocate(seq_id, prefix, len(tokens), tokens)
    bm.mark_computed(seq_id, tokens, len(tokens))


def test_keys_are_chained_sha256_of_parent_and_token_ids() -> None:
    parent = root_key()
    assert parent == hashlib.sha256(b"twinfer-prefix-cache\0").digest()
    want = hashlib.sha256(parent + b"".join(t.to_bytes(8, "little", signed=True) for t in (1, 2, 3, 4))).digest()
    assert block_key(parent, [1, 2, 3, 4]) == want
    assert block_key(parent, [1, 2, 3, 4]) != block_key(block_key(parent, [1, 2, 3, 4]), [1, 2, 3, 4])
    assert root_key(b"model-a") != root_key(b"model-b")


def test_same_prefix_hits_and_a_different_first_block_misses() -> None:
    bm = BlockManager(32, BS)
    _computed(bm, 0, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    bm.free(0)
    assert len(bm.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 42])) == 2
    assert bm.match_prefix([9, 2, 3, 4, 5, 6, 7, 8, 42]) == []
    assert bm.match_prefix([5, 6, 7, 8, 5, 6, 7, 8, 0]) == []  # block 1's tokens at position 0
    bm.check()


def test_colliding_keys_never_match_other_content(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(block_manager, "block_key", lambda parent, tokens: b"every key is this")
    bm = BlockManager(32, BS)
    x, y = [1, 2, 3, 4], [5, 6, 7, 8]
    _computed(bm, 0, x + y + [0])
    bm.free(0)
    assert bm.match_prefix(y + x + [0]) == []  # the key is found, its tokens differ
    assert len(bm.match_prefix(x + x + [0])) == 1  # block 0 is x; block 1's key hits x at the wrong place
    assert len(bm.match_prefix(x + y + [0])) == 1  # one key holds one block: y was never registered
    bm.check()


def _content_checked(key_fn, seed: int, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """Random sequences over a tiny vocabulary; every hit must be exactly the query's prefix."""
    monkeypatch.setattr(block_manager, "block_key", key_fn)
    rng = random.Random(seed)
    bm = BlockManager(24, BS)
    truth: dict[tuple[int, int], tuple[int, ...]] = {}  # (block id, generation) -> the prefix it holds
    live: list[int] = []
    for seq_id in range(60):
        tokens = [rng.randrange(3) for _ in range(rng.randrange(2, 20))]
        found = bm.match_prefix(tokens)
        for i, block_id in enumerate(found):
            assert truth[(block_id, bm.blocks[block_id].generation)] == tuple(tokens[: (i + 1) * BS])
        while live and bm.num_free < bm.blocks_for(len(tokens)):
            bm.free(live.pop(rng.randrange(len(live))))
        found = bm.match_prefix(tokens)  # freeing may have evicted some of them
        bm.allocate(seq_id, found, len(tokens), tokens)
        bm.mark_computed(seq_id, tokens, len(tokens))
        for i, block_id in enumerate(bm.table(seq_id)[: len(tokens) // BS]):
            if bm.is_registered(block_id):
                truth.setdefault((block_id, bm.blocks[block_id].generation), tuple(tokens[: (i + 1) * BS]))
        live.append(seq_id)
        bm.check()


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), modulus=st.integers(1, 4))
def test_random_traffic_with_colliding_keys_hits_only_equal_prefixes(seed: int, modulus: int) -> None:
    def weak(parent: bytes, tokens: Sequence[int]) -> bytes:
        return bytes([(sum(tokens) + len(parent)) % modulus])

    with pytest.MonkeyPatch.context() as mp:
        _content_checked(weak, seed, mp)


def test_random_traffic_with_real_keys_hits_only_equal_prefixes(monkeypatch: pytest.MonkeyPatch) -> None:
    _content_checked(block_key, 1, monkeypatch)
