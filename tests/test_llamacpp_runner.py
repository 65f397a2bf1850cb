"""LlamaCppRunner against llama-cpp-python's high-level `Llama` (the reference) and against itself.

llama.cpp's CPU kernels are not batch-invariant: a token's logits depend on how many rows share
its llama_decode call (the same happens when `Llama`'s n_batch changes). Exact comparisons
therefore reproduce the grouping: prefill with the same chunking, decode steps of at most 7 rows;
comparisons across groupings only bound the KL divergence.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

llama_cpp = pytest.importorskip("llama_cpp")

from twinfer.backends.llamacpp import DecodeError, KVCacheFull, LlamaCppOptions, LlamaCppRunner  # noqa: E402
from twinfer.runtime.batch import LogitsWanted, SeqChunk, StepBatch  # noqa: E402
from twinfer.runtime.errors import ModelError  # noqa: E402
from twinfer.runtime.loaders import default_model_path  # noqa: E402

THREADS = 2
N_CTX = 1024
TOL = 1e-3  # max |logit difference| for paths that must be exact; logits span roughly [-30, 40]
KL_REGROUPED = 5e-2  # bound on KL(p_a || p_b) when only the ubatch grouping differs (measured <= 2.7e-2)
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
]
ALL, LAST, NONE = LogitsWanted.ALL, LogitsWanted.LAST, LogitsWanted.NONE


def reference_llama(path: Path, n_batch: int = 512, repack: bool = False):
    """The high-level `Llama` with the runner's settings (flash attention; CPU weight repacking off)."""

    def model_params():
        params = default_model_params()
        params.use_extra_bufts = repack
        return params

    default_model_params = llama_cpp.llama_cpp.llama_model_default_params
    with pytest.MonkeyPatch.context() as patch:  # `Llama` has no argument for weight repacking
        patch.setattr(llama_cpp.llama_cpp, "llama_model_default_params", model_params)
        return llama_cpp.Llama(
            str(path), n_ctx=N_CTX, n_batch=n_batch, n_ubatch=n_batch, n_threads=THREADS,
            n_threads_batch=THREADS, logits_all=True, flash_attn=True, verbose=False,
        )  # fmt: skip


@pytest.fixture(scope="module")
def model_path() -> Path:
    return default_model_path()


@pytest.fixture(scope="module")
def runner(model_path: Path):
    r = LlamaCppRunner(model_path, LlamaCppOptions(n_ctx=N_CTX, max_seqs=8, n_threads=THREADS))
    yield r
    r.close()


@pytest.fixture(scope="module")
def reference(model_path: Path):
    ref = reference_llama(model_path)
    yield ref
    ref.close()


@pytest.fixture(scope="module")
def tokens(reference) -> list[list[int]]:
    return [reference.tokenize(p.encode(), add_bos=True) for p in PROMPTS]


def reference_logits(ref, toks: list[int]) -> np.ndarray:
    ref.reset()
    ref.eval(toks)
    return np.asarray(ref.scores[: len(toks)], dtype=np.float32)


def kl(p_logits: np.ndarray, q_logits: np.ndarray) -> np.ndarray:
    """KL(p || q) per row, from logits."""
    p = p_logits.astype(np.float64) - p_logits.max(-1, keepdims=True)
    q = q_logits.astype(np.float64) - q_logits.max(-1, keepdims=True)
    log_p = p - np.log(np.exp(p).sum(-1, keepdims=True))
    log_q = q - np.log(np.exp(q).sum(-1, keepdims=True))
    return (np.exp(log_p) * (log_p - log_q)).sum(-1)


def run(runner: LlamaCppRunner, seq: int, toks: list[int], start: int = 0, wanted: LogitsWanted = ALL):
    return runner.step(StepBatch([SeqChunk(seq, list(toks), start, logits=wanted)]))


def cold(runner: LlamaCppRunner, *pieces: list[int], seq: int = 999) -> np.ndarray:
    """Logits of the last piece, for a fresh sequence fed `pieces` as consecutive steps; then released."""
    try:
        start = 0
        for piece in pieces:
            out = run(runner, seq, piece, start)
            start += len(piece)
        return out
    finally:
        runner.release(seq)


def greedy(
    runner: LlamaCppRunner, prompts: list[list[int]], seqs: list[int], steps: int, batched_prefill: bool
):
    """Greedy-decode all prompts, one token per sequence per step; returns tokens and logits [S, steps(, V)]."""
    if batched_prefill:
        out = runner.step(StepBatch([SeqChunk(s, list(p), 0) for s, p in zip(seqs, prompts, strict=True)]))
    else:
        out = np.concatenate([run(runner, s, p, wanted=LAST) for s, p in zip(seqs, prompts, strict=True)])
    logits, toks = [out], [out.argmax(-1)]
    pos = [len(p) for p in prompts]
    for _ in range(steps - 1):
        out = runner.step(
            StepBatch([SeqChunk(s, [int(t)], p) for s, t, p in zip(seqs, toks[-1], pos, strict=True)])
        )
        logits.append(out)
        toks.append(out.argmax(-1))
        pos = [p + 1 for p in pos]
    for s in seqs:
        runner.release(s)
    return np.stack(toks, 1), np.stack(logits, 1)


def test_prefill_matches_llama_reference(runner, reference, tokens):
    toks = tokens[2]
    want = reference_logits(reference, toks)
    got = cold(runner, toks)
    assert got.shape == (len(toks), runner.n_vocab) == want.shape
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_repack_matches_stock_llama(model_path, tokens):
    """repack=True is llama.cpp's stock CPU setup: exact against `Llama`, close to the runner's default."""
    toks = tokens[2]
    stock = reference_llama(model_path, repack=True)
    try:
        want = reference_logits(stock, toks)
    finally:
        stock.close()
    with LlamaCppRunner(model_path, LlamaCppOptions(n_ctx=N_CTX, max_seqs=2, n_threads=THREADS, repack=True)) as repacked:
        np.testing.assert_allclose(cold(repacked, toks), want, atol=TOL, rtol=0)
    with LlamaCppRunner(model_path, LlamaCppOptions(n_ctx=N_CTX, max_seqs=2, n_threads=THREADS)) as plain:
        assert kl(want, cold(plain, toks)).max() < KL_REGROUPED


def test_last_row_is_last_position_of_all(runner, tokens):
    all_rows = cold(runner, tokens[0])
    last = run(runner, 1, tokens[0], wanted=LAST)
    runner.release(1)
    assert last.shape == (1, runner.n_vocab)
    np.testing.assert_allclose(last[0], all_rows[-1], atol=TOL, rtol=0)


def test_batched_decode_equals_one_at_a_time(runner, tokens):
    """4 sequences in every decode step give the same logits and greedy tokens as each alone.

    Exact because a 4-row llama_decode call uses the same CPU kernels as a 1-row one; at 8+ rows
    llama.cpp switches matmul tiles and logits move by up to ~1 (see LlamaCppRunner's docstring).
    """
    batched_toks, batched_logits = greedy(runner, tokens, [10, 11, 12, 13], 16, batched_prefill=False)
    for i, prompt in enumerate(tokens):
        alone_toks, alone_logits = greedy(runner, [prompt], [20], 16, batched_prefill=False)
        np.testing.assert_allclose(batched_logits[i], alone_logits[0], atol=TOL, rtol=0)
        assert batched_toks[i].tolist() == alone_toks[0].tolist(), f"prompt {i} diverged"


def test_decode_rows_next_to_a_prefill_chunk(runner, tokens):
    """Continuous batching: one-token chunks beside a short prefill are exact, beside a long one close."""
    first, second = tokens[0], tokens[3]
    for newcomer, exact in ((tokens[2][:5], True), (tokens[2], False)):
        for seq, prompt in ((80, first), (81, second)):
            run(runner, seq, prompt, wanted=NONE)
        decode = [SeqChunk(80, [506], len(first)), SeqChunk(81, [236764], len(second))]
        mixed = runner.step(StepBatch([decode[0], SeqChunk(82, newcomer, 0, logits=NONE), decode[1]]))
        for seq in (80, 81, 82):
            runner.release(seq)
        alone = np.concatenate([cold(runner, first, [506]), cold(runner, second, [236764])])
        if exact:  # 7 rows in the llama_decode call
            np.testing.assert_allclose(mixed, alone, atol=TOL, rtol=0)
        else:  # 16 rows: llama.cpp picks other matmul tiles (see LlamaCppRunner's docstring)
            assert kl(alone, mixed).max() < KL_REGROUPED


def test_batched_prefill_is_close_to_one_at_a_time(runner, tokens):
    """Prefilling 4 prompts in one step regroups their tokens: close, not bit-exact (see module doc)."""
    _, batched = greedy(runner, tokens, [10, 11, 12, 13], 1, batched_prefill=True)
    _, alone = greedy(runner, tokens, [10, 11, 12, 13], 1, batched_prefill=False)
    assert kl(alone[:, 0], batched[:, 0]).max() < KL_REGROUPED


def test_chunked_prefill_matches_reference_with_same_chunking(model_path, runner, tokens):
    toks = tokens[2] + tokens[1][1:] + tokens[3][1:]
    seq, size = 30, 7
    for start in range(0, len(toks), size):
        wanted = LAST if start + size >= len(toks) else NONE
        out = run(runner, seq, toks[start : start + size], start, wanted)
        assert out.shape == ((1 if wanted is LAST else 0), runner.n_vocab)
    runner.release(seq)
    ref7 = reference_llama(model_path, n_batch=size)
    try:
        np.testing.assert_allclose(out[0], reference_logits(ref7, toks)[-1], atol=TOL, rtol=0)
    finally:
        ref7.close()
    assert kl(cold(runner, toks)[-1:], out).max() < KL_REGROUPED  # one-shot prefill groups differently


def test_copy_prefix_then_continue_equals_cold(runner, tokens):
    shared, tail_a, tail_b = tokens[2], tokens[0][1:], tokens[3][1:]
    run(runner, 40, shared, wanted=NONE)
    run(runner, 40, tail_a, len(shared), NONE)
    runner.copy_prefix(40, 41, len(shared))
    assert runner.num_stored(41) == len(shared)
    got = run(runner, 41, tail_b, len(shared))
    # the source keeps its own continuation: one more token on it still matches a cold sequence
    src_next = run(runner, 40, tail_b[:1], len(shared) + len(tail_a))
    runner.release(40)
    runner.release(41)
    np.testing.assert_allclose(got, cold(runner, shared, tail_b), atol=TOL, rtol=0)
    np.testing.assert_allclose(src_next, cold(runner, shared, tail_a, tail_b[:1]), atol=TOL, rtol=0)


def test_release_frees_slot_for_a_fresh_sequence(runner, tokens):
    fresh = cold(runner, tokens[1])
    run(runner, 50, tokens[2], wanted=NONE)
    slot = runner._slots[50]
    runner.release(50)
    assert 50 not in runner._slots
    got = run(runner, 51, tokens[1])
    assert runner._slots[51] == slot  # the freed slot was reused
    runner.release(51)
    np.testing.assert_allclose(got, fresh, atol=TOL, rtol=0)


def test_rollback_restep_from_earlier_start(runner, tokens):
    """Decode 5 tokens, roll back 3 of them and verify 4 others (as speculative decoding does)."""
    prompt, tail, other = tokens[0], tokens[3][1:6], tokens[1][1:5]
    run(runner, 60, prompt, wanted=NONE)
    for i, t in enumerate(tail):
        run(runner, 60, [t], len(prompt) + i, LAST)
    back = len(prompt) + 2
    got = run(runner, 60, other, back)
    assert runner.num_stored(60) == back + len(other)
    runner.release(60)
    np.testing.assert_allclose(got, cold(runner, prompt, tail[:1], tail[1:2], other), atol=TOL, rtol=0)


def test_small_n_batch_splits_steps_exactly(model_path, runner, tokens):
    """A step larger than n_batch is split over several llama_decode calls; rows keep batch order.

    Expected: the same windows of 8 tokens fed to the big runner as separate steps.
    """
    chunks = [SeqChunk(i, list(t), 0, logits=ALL if i % 2 else LAST) for i, t in enumerate(tokens)]
    flat = [(c, j) for c in chunks for j in range(len(c.tokens))]
    want = []
    for w in range(0, len(flat), 8):
        window: dict[int, list[int]] = {}
        for c, j in flat[w : w + 8]:
            window.setdefault(c.seq_id, []).append(j)
        pieces = []
        for seq, js in window.items():
            c = chunks[seq]
            last = js[-1] == len(c.tokens) - 1
            wanted = ALL if c.logits is ALL else (LAST if last else NONE)
            pieces.append(SeqChunk(seq, c.tokens[js[0] : js[-1] + 1], js[0], logits=wanted))
        want.append(runner.step(StepBatch(pieces)))
    for c in chunks:
        runner.release(c.seq_id)
    with LlamaCppRunner(model_path, LlamaCppOptions(n_ctx=256, max_seqs=4, n_threads=THREADS, n_batch=8)) as small:
        assert small.describe()["n_batch"] == 8
        got = small.step(StepBatch(chunks))
    assert got.shape == (sum(c.logit_rows for c in chunks), runner.n_vocab)
    np.testing.assert_allclose(got, np.concatenate(want), atol=TOL, rtol=0)


def test_kv_cache_full_raises_and_restores(model_path, tokens):
    with LlamaCppRunner(model_path, LlamaCppOptions(n_ctx=64, max_seqs=2, n_threads=THREADS, n_batch=32)) as small:
        prompt = tokens[0]
        run(small, 0, prompt, wanted=LAST)
        too_long = (tokens[2] * 64)[: small.n_ctx]  # with the prompt, one window too many
        with pytest.raises(KVCacheFull):
            small.step(StepBatch([SeqChunk(1, too_long, 0, logits=LAST)]))
        assert small.num_stored(1) == 0 and small.num_stored(0) == len(prompt)
        assert isinstance(KVCacheFull("x", 1), (DecodeError, RuntimeError))


def test_bad_steps_are_rejected(runner, tokens):
    with pytest.raises(ValueError, match="two chunks"):
        runner.step(StepBatch([SeqChunk(70, [2], 0), SeqChunk(70, [3], 1)]))
    with pytest.raises(ValueError, match="only 0 are stored"):
        runner.step(StepBatch([SeqChunk(71, [2, 3], 5)]))
    with pytest.raises(ValueError, match="vocabulary"):
        runner.step(StepBatch([SeqChunk(72, [runner.n_vocab], 0)]))
    assert runner.step(StepBatch([])).shape == (0, runner.n_vocab)


@pytest.mark.parametrize("content", ["missing", "directory", b"not a model at all", b"GGUF" + bytes(100)])
def test_bad_model_files_raise_model_error(tmp_path, content):
    path = tmp_path / "model.gguf"
    if content == "directory":
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    with pytest.raises(ModelError, match=re.escape(str(path))) as err:
        LlamaCppRunner(path, LlamaCppOptions(n_ctx=64))
    assert "\n" not in str(err.value)  # one line for the CLI


def test_quiet_unless_verbose(model_path, capfd):
    LlamaCppRunner(model_path, LlamaCppOptions(n_ctx=256, max_seqs=1, n_threads=THREADS, verbose=True)).close()
    assert "llama" in capfd.readouterr().err  # llama.cpp's own loader log reaches stderr
    LlamaCppRunner(model_path, LlamaCppOptions(n_ctx=256, max_seqs=1, n_threads=THREADS)).close()
    assert capfd.readouterr().err == ""


def test_coarse_spec_agrees_with_the_gguf_loader(runner):
    """The fallback spec (for architectures twinfer lacks) reads the same sizes from llama.cpp."""
    from twinfer.backends.llamacpp.metadata import spec_from_model

    coarse = spec_from_model(runner._lib, runner._model, runner.n_vocab)
    sizes = ("model_type", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim")
    sizes += ("intermediate_size", "max_position", "rope_theta", "sliding_window")
    assert {k: getattr(coarse, k) for k in sizes} == {k: getattr(runner.spec, k) for k in sizes}


def test_describe_and_spec(runner):
    info = runner.describe()
    assert info["backend"] == "llamacpp" and info["n_threads"] == THREADS and info["n_ctx"] == N_CTX
    assert info["llama_cpp_python"] == llama_cpp.__version__
    assert "gemma3" in info["model"]
    assert runner.spec.model_type == "gemma3" and runner.spec.vocab_size == runner.n_vocab
    assert runner.spec.layer_types  # the GGUF loader's exact spec, not llama.cpp's coarse one
    assert runner.kv.paged is False and runner.kv.capacity_tokens == N_CTX and runner.kv.max_seqs == 8
    assert info["threadpool"] == "persistent"  # as llama-server and llama-bench attach one


def test_the_persistent_thread_pool_changes_no_logit(model_path, runner, tokens, monkeypatch):
    import twinfer.backends.llamacpp.runner as runner_module

    monkeypatch.setattr(runner_module, "attach_threadpool", lambda *args: None)
    bare = LlamaCppRunner(model_path, LlamaCppOptions(n_ctx=N_CTX, max_seqs=8, n_threads=THREADS))
    try:
        assert bare.describe()["threadpool"] == "per-graph"
        toks = tokens[0]
        pooled = [runner.step(StepBatch([SeqChunk(900, toks, 0, logits=LogitsWanted.ALL)]))]
        plain = [bare.step(StepBatch([SeqChunk(900, toks, 0, logits=LogitsWanted.ALL)]))]
        for i in range(4):  # then one-token decode steps, as a stream runs
            nxt = [int(np.argmax(plain[-1][-1]))]
            pooled.append(runner.step(StepBatch([SeqChunk(900, nxt, len(toks) + i)])))
            plain.append(bare.step(StepBatch([SeqChunk(900, nxt, len(toks) + i)])))
        for a, b in zip(pooled, plain, strict=True):
            np.testing.assert_array_equal(a, b)
    finally:
        runner.release(900)
        bare.close()


def test_weights_on_huge_pages_change_no_logit(model_path, tokens, monkeypatch):
    """Where the weights live (mapped file pages, or llama.cpp's buffers on 2 MiB pages) moves no logit.
    On a kernel that gives huge pages the weights get them, and the runner asks for the KV cache's chunks
    too (most of its sliding-window layers' 62 MB at 4,096 tokens, under the weights' size); whether
    the kernel then has a free huge page for each is its say, so the fold's result is only bounded."""
    from twinfer.backends.llamacpp import hugepages
    from twinfer.runtime.cpu import HUGE_PAGE_MODES, thp_mode

    asked: list[tuple[int, int]] = []  # (resident chunk bytes, limit) of each context fold
    fold = hugepages.fold

    def spy(ranges, limit=None):
        chunks = sum(len(hugepages.resident_chunks(a, b)) for a, b in ranges) * hugepages.HUGE
        asked.append((chunks, limit))
        return fold(ranges, limit)

    monkeypatch.setattr(hugepages, "fold", spy)
    runs = []
    for huge in (True, False):
        r = LlamaCppRunner(model_path, LlamaCppOptions(n_ctx=4096, max_seqs=1, n_threads=THREADS, huge_pages=huge))
        try:
            toks = tokens[0]
            out = [r.step(StepBatch([SeqChunk(1, toks, 0, logits=LogitsWanted.ALL)]))]
            for i in range(3):
                out.append(r.step(StepBatch([SeqChunk(1, [int(np.argmax(out[-1][-1]))], len(toks) + i)])))
            info = r.describe()
            runs.append((out, info["huge_page_weights_mb"], info["huge_page_context_mb"]))
        finally:
            r.close()
    (huge_out, huge_mb, huge_kv_mb), (mapped_out, mapped_mb, mapped_kv_mb) = runs
    for a, b in zip(huge_out, mapped_out, strict=True):
        np.testing.assert_array_equal(a, b)
    assert mapped_mb == mapped_kv_mb == 0
    if hugepages.supported() and thp_mode() in HUGE_PAGE_MODES:
        assert huge_mb > 0  # of 235 MB of weights (274 MB measured here: the advice covers whole chunks)
        (chunks, limit), (mapped_chunks, _) = [a for a in asked if a[1] is not None]  # the weights': no limit
        assert mapped_chunks == 0
        assert 32 * 2**20 <= chunks <= limit == model_path.stat().st_size  # most of the 62 MB (58 MiB seen)
        assert 0 <= huge_kv_mb * 2**20 <= chunks


def test_huge_pages_asked_for_where_there_are_none_load_mapped(model_path, monkeypatch):
    """Off Linux (no /proc to find the buffers in) `huge_pages=True` is a no-op, not a crash."""
    from twinfer.backends.llamacpp import hugepages

    monkeypatch.setattr(hugepages, "supported", lambda: False)
    monkeypatch.setattr(hugepages, "maps", lambda: pytest.fail("read /proc/self/maps off Linux"))
    r = LlamaCppRunner(model_path, LlamaCppOptions(n_ctx=256, max_seqs=1, n_threads=THREADS, huge_pages=True))
    try:
        info = r.describe()
        assert info["huge_page_weights_mb"] == 0 and info["huge_page_context_mb"] == 0
        assert r.step(StepBatch([SeqChunk(1, [2, 9], 0)])).shape == (1, r.n_vocab)
    finally:
        r.close()


def test_borrowed_logits_are_the_step_s_own_until_the_next_call(runner, tokens):
    """The engine's `step_borrowed` reads llama.cpp's logits buffer in place; `step` hands out a copy
    that a later decode leaves alone."""
    prompt = tokens[0]
    owned = cold(runner, prompt[:-1], [prompt[-1]], seq=7)
    try:
        runner.step(StepBatch([SeqChunk(7, list(prompt[:-1]), 0, logits=NONE)]))
        borrowed = runner.step_borrowed(StepBatch([SeqChunk(7, [prompt[-1]], len(prompt) - 1)]))
        assert not borrowed.flags.owndata and np.array_equal(borrowed, owned)
        kept = runner.step(StepBatch([SeqChunk(7, [int(owned.argmax())], len(prompt))]))
        again = kept.copy()
        runner.step_borrowed(StepBatch([SeqChunk(7, [int(kept.argmax())], len(prompt) + 1)]))
        assert kept.flags.owndata and np.array_equal(kept, again)  # the copy outlives the next decode
        assert not np.array_equal(borrowed, owned)  # ...where the borrowed view did not
    finally:
        runner.release(7)
