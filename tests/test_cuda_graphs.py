"""CUDA graphs for decode at batch-size buckets: the buckets, the padding (on CPU), the capture (on a GPU).

A replay computes a decode step padded to its bucket with the graphs' fixed-width inputs; `step_padded`
runs exactly that eagerly, so the CPU tests check that padding rows change no real row's logits and
write only the scratch KV block. The capture itself needs a GPU (`-m cuda`, in bench/gpu_check.sh).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")  # the kernel-path case interprets triton on CPU
torch = pytest.importorskip("torch")

from tests.test_parallel import SPECS, weights  # noqa: E402
from twinfer.backends.cuda.graphs import (  # noqa: E402
    bucket_for,
    decode_buckets,
    pad_decode_batch,
    wanted_rows,
)
from twinfer.backends.cuda.runner import build_torch_runner  # noqa: E402
from twinfer.runtime.batch import LogitsWanted, SeqChunk, StepBatch  # noqa: E402

BLOCK, KV_TOKENS = 4, 128
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # else the kernel-path case runs on the GPU
PROMPTS = [[5, 17, 3, 88, 41, 9, 60], [12, 70, 33], [7, 7, 21, 40, 2]]


def tables(n: int) -> list[list[int]]:
    per = KV_TOKENS // BLOCK // n
    return [list(range(i * per, (i + 1) * per))[::-1] for i in range(n)]  # scattered: reversed blocks


def run_decode(runner: object, steps: int, padded_to: int | None) -> tuple[np.ndarray, list[int]]:
    """Prefill PROMPTS eagerly, then greedy decode steps (padded to a bucket when `padded_to`)."""
    tbl = tables(len(PROMPTS))
    first = runner.step(StepBatch([SeqChunk(i, p, 0, tbl[i]) for i, p in enumerate(PROMPTS)]))  # type: ignore[attr-defined]
    toks = [int(t) for t in first.argmax(-1)]
    rows, out = [], list(toks)
    for s in range(steps):
        chunks = [SeqChunk(i, [toks[i]], len(p) + s, tbl[i]) for i, p in enumerate(PROMPTS)]
        chunks[1].logits = LogitsWanted.NONE if s == 1 else LogitsWanted.LAST  # a row nobody asked for
        batch = StepBatch(chunks)
        r = runner.step_padded(batch, padded_to) if padded_to else runner.step(batch)  # type: ignore[attr-defined]
        rows.append(r)
        got = iter(int(t) for t in r.argmax(-1))
        toks = [next(got) if c.logit_rows else toks[i] for i, c in enumerate(chunks)]
        out += toks
    return np.concatenate(rows), out


def test_replay_inputs_are_the_eager_steps_static_inputs() -> None:
    """What a replay copies in (built without the eager step's gather indices) equals what begin_step builds."""
    from twinfer.backends.cuda.graphs import STATIC_INPUTS

    device = "cpu" if INTERPRETED or not torch.cuda.is_available() else "cuda"
    runner = build_torch_runner(SPECS["llama"], weights("llama"), kv_tokens=KV_TOKENS, block_size=BLOCK,
                                kernels="triton", cuda_graphs=False, device=device)
    tbl = tables(3)
    batch = pad_decode_batch(StepBatch([SeqChunk(i, [9 + i], 5 + 4 * i, tbl[i]) for i in range(3)]), 4,
                             runner.scratch_block)
    eager = runner.torch_ops.begin_step(batch, runner.table_width)
    replay = runner.torch_ops.decode_inputs(batch, runner.table_width)
    for name in STATIC_INPUTS:
        want = getattr(eager, name)
        assert replay[name].dtype == np.dtype(str(want.dtype).removeprefix("torch.")), name
        assert np.array_equal(replay[name], want.cpu().numpy()), name


def test_buckets() -> None:
    assert decode_buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert decode_buckets(48) == [1, 2, 4, 8, 16, 32, 48] and decode_buckets(1) == [1]
    assert [bucket_for(n, decode_buckets(48)) for n in (1, 3, 33, 48, 49)] == [1, 4, 48, 48, None]


def test_padding_chunks_write_only_the_scratch_block() -> None:
    batch = StepBatch([SeqChunk(4, [9], 6, [2, 3]), SeqChunk(8, [1], 2, [5], LogitsWanted.NONE)])
    padded = pad_decode_batch(batch, 4, scratch_block=99)
    assert padded.slot_mapping(4)[2:] == [99 * 4] * 2 and padded.num_logit_rows == 4
    assert [c.seq_id for c in padded.chunks] == [4, 8, -1, -2] and wanted_rows(batch) == [0]
    with pytest.raises(ValueError, match="3 sequences do not fit a decode bucket of 2"):
        pad_decode_batch(StepBatch(batch.chunks + batch.chunks[:1]), 2, 99)


@pytest.mark.parametrize(("arch", "kernels"), [("llama", "torch"), ("qwen3_moe", "torch"), ("qwen3_moe", "triton")])
def test_padded_decode_gives_the_unpadded_logits(arch: str, kernels: str) -> None:
    def runner() -> object:
        device = "cuda" if kernels == "triton" and not INTERPRETED else "cpu"
        return build_torch_runner(SPECS[arch], weights(arch), kv_tokens=KV_TOKENS, block_size=BLOCK, kernels=kernels,
                                  device=device, cuda_graphs=False, padded_steps=True)

    plain, padded = runner(), runner()
    want_rows, want_tokens = run_decode(plain, 3, None)
    got_rows, got_tokens = run_decode(padded, 3, 8)  # 3 real rows + 5 padding rows
    assert got_rows.shape == want_rows.shape == (8, SPECS[arch].vocab_size)  # 3 + 2 + 3 rows asked for
    assert np.abs(got_rows - want_rows).max() <= 1e-5 and got_tokens == want_tokens
    ops_a, ops_b = plain.torch_ops, padded.torch_ops  # type: ignore[attr-defined]
    scratch = padded.scratch_block * BLOCK  # type: ignore[attr-defined]
    for layer in range(SPECS[arch].num_layers):  # real KV identical; only the padded runner touched the scratch
        ka, kb = ops_a.k_cache[layer].cpu(), ops_b.k_cache[layer].cpu()
        assert torch.allclose(ka[:scratch], kb[:scratch], atol=1e-6)
        assert ka[scratch:].abs().max() == 0 < kb[scratch:].abs().max()


def test_graphs_stay_off_where_they_cannot_run() -> None:
    r = build_torch_runner(SPECS["llama"], weights("llama"), kv_tokens=KV_TOKENS, block_size=BLOCK)
    assert r.graphs_off == "device cpu" and "off (device cpu)" in r.describe()["cuda_graphs"]
    assert build_torch_runner(SPECS["llama"], weights("llama"), kv_tokens=KV_TOKENS, block_size=BLOCK,
                              cuda_graphs=False).graphs_off == "cuda_graphs=False"
    # no graphs, no scratch block: the cache is exactly what the engine (and the planner) counts
    assert r.kv.num_blocks == KV_TOKENS // BLOCK and r.torch_ops.k_cache[0].shape[0] == KV_TOKENS
    with pytest.raises(ValueError, match="padded_steps"):
        r.step_padded(StepBatch([]), 2)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED,
                    reason="needs an NVIDIA GPU with compiled triton kernels (TRITON_INTERPRET=0)")
@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_graph_replays_match_eager_on_a_gpu(arch: str) -> None:
    def runner(graphs: bool) -> object:
        return build_torch_runner(SPECS[arch], weights(arch), kv_tokens=KV_TOKENS, block_size=BLOCK, device="cuda",
                                  cuda_graphs=graphs)

    eager, graphed = runner(False), runner(True)
    assert graphed.graphs_off is None, graphed.graphs_off  # type: ignore[attr-defined]
    want_rows, want_tokens = run_decode(eager, 4, None)
    got_rows, got_tokens = run_decode(graphed, 4, None)
    assert sorted(graphed.graphs) == [4]  # type: ignore[attr-defined]  # 3 sequences replay the bucket of 4
    assert np.abs(got_rows - want_rows).max() <= 1e-4 and got_tokens == want_tokens
    single = graphed.step(StepBatch([SeqChunk(0, [got_tokens[-3]], len(PROMPTS[0]) + 4, tables(3)[0])]))  # type: ignore[attr-defined]
    assert sorted(graphed.graphs) == [1, 4] and single.shape == (1, SPECS[arch].vocab_size)  # type: ignore[attr-defined]
