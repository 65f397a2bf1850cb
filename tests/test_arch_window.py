"""gpt-oss's sliding-window layers keep KV bounded by the window: a sequence longer than the window holds
at most ceil(window / block) + 1 blocks in them between decode steps (and the running chunk's), the
caches are allocated for the window, and the logits still match transformers to 1e-4.

The checkpoints are test_arch_logits' gpt_oss cases (windows 4 and 6, sinks, one or two sliding layers).
"""

from __future__ import annotations

import numpy as np
import pytest

from twinfer.runtime.batch import LogitsWanted, SeqChunk, StepBatch
from twinfer.runtime.kv.window import NULL_BLOCK, WindowBlocks, per_sequence
from twinfer.runtime.loaders import load_model

pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_arch_logits import PROMPT_A, TOL, hf_logits, saved  # noqa: E402

from twinfer.backends.cuda.window import build_windowed_torch_runner  # noqa: E402

BLOCK = 2
CHUNK = 4
STEPS = 12


def test_window_blocks_free_what_the_window_left_behind() -> None:
    w = WindowBlocks(num_blocks=8, block_size=2, window=3)
    assert w.table(1, 0, 4) == [1, 2]
    assert w.table(1, 4, 6) == [NULL_BLOCK, 2, 1]  # queries from 4 read keys from 2: block 1 is dead, and reused
    assert w.held(1) == 2 and w.num_free == 5  # 7 usable blocks (0 is the null block)
    assert w.table(1, 5, 6) == [NULL_BLOCK, 2, 1]  # a rollback into the last chunk keeps what it needs
    with pytest.raises(ValueError, match="before the window"):
        w.table(1, 1, 2)
    with pytest.raises(ValueError, match="prefix"):
        w.table(2, 4, 5)
    w.release(1)
    assert w.num_free == 7
    assert per_sequence(3, 2, 1) == 3


@pytest.mark.parametrize("case", ["gpt_oss-a", "gpt_oss-b"])
def test_sliding_layers_hold_the_window_and_logits_match(case: str) -> None:
    loaded = load_model(saved(case))
    spec = loaded.spec
    window = max(spec.window(i) or 0 for i in range(spec.num_layers))
    runner = build_windowed_torch_runner(spec, loaded.weights, max_seqs=1, max_chunk=CHUNK, kv_tokens=64,
                                         block_size=BLOCK)
    ops = runner.window_ops
    sliding = [i for i in range(spec.num_layers) if spec.window(i)]
    full = [i for i in range(spec.num_layers) if not spec.window(i)]
    pool = per_sequence(window, BLOCK, CHUNK) + 1
    for i in sliding:  # allocated for the window, not the context
        assert ops.k_cache[i].shape[0] == ops.v_cache[i].shape[0] == pool * BLOCK < 64
    for i in full:
        assert ops.k_cache[i].shape[0] == 64
    table = list(range(-(-(len(PROMPT_A) + STEPS) // BLOCK)))
    rows, tokens = [], list(PROMPT_A)
    for start in range(0, len(PROMPT_A), CHUNK):  # chunked prefill, then decode
        chunk = PROMPT_A[start : start + CHUNK]
        rows.append(runner.step(StepBatch([SeqChunk(0, chunk, start, table, LogitsWanted.ALL)])))
        assert runner.window.held(0) <= per_sequence(window, BLOCK, CHUNK)
    for _ in range(STEPS):
        tokens.append(int(rows[-1][-1].argmax()))
        rows.append(runner.step(StepBatch([SeqChunk(0, [tokens[-1]], len(tokens) - 1, table)])))
        assert runner.window.held(0) <= -(-window // BLOCK) + 1  # the window, block-rounded
    assert len(tokens) > 2 * window
    got = np.concatenate(rows)
    want = hf_logits(case, tuple(tokens))[: len(got)]
    assert float(np.abs(got - want).max()) <= TOL
    runner.kv_sync(None, 1, lambda: 0).finished(0, table)  # type: ignore[arg-type]
    assert runner.window.held(0) == 0 and runner.window.num_free == pool - 1


def test_engine_text_equals_the_full_length_runner() -> None:
    """Through the engine (chunked prefill, three sequences at once, sequences finishing and freeing
    their window blocks), greedy tokens equal the full-length torch runner's."""
    from twinfer.backends.cuda.runner import load_torch_runner
    from twinfer.runtime.engine.engine import Engine, EngineConfig
    from twinfer.runtime.engine.params import SamplingParams

    loaded = load_model(saved("gpt_oss-b"))
    prompts = [PROMPT_A, PROMPT_A[3:], [5, 9, 2, 7, 7, 1, 30, 44, 12]]
    params = SamplingParams(max_tokens=10, temperature=0.0)
    config = EngineConfig(max_seqs=3, max_prefill_chunk=CHUNK, max_batch_tokens=8)

    def texts(runner: object) -> list[list[int]]:
        return [o.token_ids for o in Engine(runner, None, config).generate(prompts, params)]  # type: ignore[arg-type]

    windowed = build_windowed_torch_runner(loaded.spec, loaded.weights, max_seqs=3, max_chunk=8, kv_tokens=128,
                                           block_size=BLOCK)
    assert texts(windowed) == texts(load_torch_runner(loaded, kv_tokens=128, block_size=BLOCK))
    assert windowed.window.num_free == windowed.window.num_blocks - 1  # every finished sequence gave its blocks back
