"""Tensor, expert and pipeline parallelism over gloo on CPU processes against one process.

Each configuration starts its ranks once and runs a scripted workload through them: a batched
prefill of two sequences (one chunked, one whose prefill wants no logits at first), then greedy
decode of both. Logits must match the single-process torch runner to 1e-5 in float32 and the
greedy tokens must be identical.
"""

from __future__ import annotations

from functools import cache

import numpy as np
import pytest

from twinfer.runtime.batch import LogitsWanted, SeqChunk, StepBatch
from twinfer.runtime.errors import PlanError, TwinferError
from twinfer.runtime.spec import ModelSpec, MoESpec

torch = pytest.importorskip("torch")

from twinfer.backends.cuda.parallel import ParallelConfig, RankPosition, RunOptions, WeightSource, launch  # noqa: E402
from twinfer.backends.cuda.parallel.layout import stage_layers  # noqa: E402
from twinfer.backends.cuda.parallel.wire import decode, encode  # noqa: E402
from twinfer.backends.cuda.runner import build_torch_runner  # noqa: E402

TOL = 1e-5
BLOCK, KV_TOKENS = 4, 256
DECODE_STEPS = 5
SPECS = {
    # one KV head under --tp 2: each rank keeps a copy of it (replication path)
    "llama": ModelSpec("llama", vocab_size=96, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=1,
                       head_dim=16, intermediate_size=96),
    # tied embeddings (the vocab-parallel embedding doubles as lm_head), QK-norm, 4 experts top-2
    "qwen3_moe": ModelSpec("qwen3_moe", vocab_size=96, hidden_size=64, num_layers=2, num_heads=4,
                           num_kv_heads=2, head_dim=16, intermediate_size=96, qk_norm=True,
                           tie_word_embeddings=True,
                           moe=MoESpec(num_experts=4, top_k=2, expert_intermediate_size=24)),
}  # fmt: skip


@cache
def weights(arch: str) -> dict[str, np.ndarray]:
    """Random canonical weights at a scale that gives O(1) logits and uneven routing."""
    s = SPECS[arch]
    rng = np.random.default_rng(0)
    C, D, inter = s.hidden_size, s.head_dim, s.intermediate_size

    def w(*shape: int) -> np.ndarray:
        return (rng.normal(size=shape) * shape[-1] ** -0.5).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return rng.normal(1.0, 0.2, size=n).astype(np.float32)

    out = {"embed": (rng.normal(size=(s.vocab_size, C)) * 0.25).astype(np.float32), "norm": norm(C)}  # O(1) logits when tied
    if not s.tie_word_embeddings:
        out["lm_head"] = w(s.vocab_size, C)
    for i in range(s.num_layers):
        p = f"layers.{i}."
        out |= {p + "attn_norm": norm(C), p + "mlp_norm": norm(C), p + "q": w(s.q_size, C), p + "k": w(s.kv_size, C),
                p + "v": w(s.kv_size, C), p + "o": w(C, s.q_size)}  # fmt: skip
        if s.qk_norm:
            out |= {p + "q_norm": norm(D), p + "k_norm": norm(D)}
        if s.moe:
            E, J = s.moe.num_experts, s.moe.expert_intermediate_size
            out |= {p + "router": w(E, C) * 4, p + "experts.gate": w(E, J, C), p + "experts.up": w(E, J, C),
                    p + "experts.down": w(E, C, J)}  # fmt: skip
        else:
            out |= {p + "gate": w(inter, C), p + "up": w(inter, C), p + "down": w(C, inter)}
    return out


def workload(runner: object) -> tuple[np.ndarray, list[int]]:
    """Every logit row and greedy token of a fixed two-sequence script through `runner.step`."""
    a, b = [5, 17, 3, 88, 41, 9, 60], [12, 70, 33, 2, 95]
    ta, tb = [0, 3, 6, 9, 12], [1, 4, 7, 10, 13]
    step = runner.step  # type: ignore[attr-defined]
    rows = [step(StepBatch([SeqChunk(0, a, 0, ta, LogitsWanted.ALL), SeqChunk(1, b[:3], 0, tb, LogitsWanted.NONE)]))]
    rows.append(step(StepBatch([SeqChunk(1, b[3:], 3, tb)])))
    na, nb = len(a), len(b)
    toks = [int(rows[0][-1].argmax()), int(rows[1][-1].argmax())]
    out = list(toks)
    for i in range(DECODE_STEPS):
        r = step(StepBatch([SeqChunk(0, [toks[0]], na + i, ta), SeqChunk(1, [toks[1]], nb + i, tb)]))
        rows.append(r)
        toks = [int(r[0].argmax()), int(r[1].argmax())]
        out += toks
    return np.concatenate(rows), out


@cache
def reference(arch: str) -> tuple[np.ndarray, list[int]]:
    return workload(build_torch_runner(SPECS[arch], weights(arch), kv_tokens=KV_TOKENS, block_size=BLOCK))


def engine_outputs(runner: object) -> list[list[int]]:
    """Greedy completions of 8 prompts of different lengths, scheduled together by the engine."""
    from twinfer.runtime.engine import Engine, EngineConfig, SamplingParams

    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 96, size=n).tolist() for n in (3, 9, 4, 12, 6, 1, 7, 10)]
    engine = Engine(runner, None, EngineConfig(max_seqs=8, max_batch_tokens=32))  # type: ignore[arg-type]
    return [out.token_ids for out in engine.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0))]


def parallel(arch: str, config: ParallelConfig) -> tuple[np.ndarray, list[int], list[list[int]] | None]:
    source = WeightSource(spec=SPECS[arch], weights=weights(arch))
    runner = launch(source, config, RunOptions(kv_tokens=KV_TOKENS, block_size=BLOCK, timeout_s=120))
    try:
        assert runner.describe()["world_size"] == config.world_size
        rows, tokens = workload(runner)
        return rows, tokens, engine_outputs(runner) if config == ParallelConfig(tp=2) else None
    finally:
        runner.close()


CONFIGS = [
    ("llama", ParallelConfig(tp=2)),
    ("llama", ParallelConfig(pp=2)),
    ("qwen3_moe", ParallelConfig(tp=2)),
    ("qwen3_moe", ParallelConfig(ep=2)),
    ("qwen3_moe", ParallelConfig(pp=2)),
    ("qwen3_moe", ParallelConfig(tp=2, ep=2)),
    # all-to-all dispatch and combine (decode steps of 2 tokens over 4 ranks: some ranks own no tokens)
    ("qwen3_moe", ParallelConfig(ep=2, ep_dispatch="all_to_all")),
    ("qwen3_moe", ParallelConfig(tp=2, ep=2, ep_dispatch="all_to_all")),
]


@pytest.mark.parametrize(("arch", "config"), CONFIGS, ids=[f"{a}-{c.describe()}" for a, c in CONFIGS])
def test_parallel_matches_single_process(arch: str, config: ParallelConfig) -> None:
    want_rows, want_tokens = reference(arch)
    got_rows, got_tokens, engine_tokens = parallel(arch, config)
    assert got_rows.shape == want_rows.shape
    assert np.abs(got_rows - want_rows).max() <= TOL
    assert got_tokens == want_tokens
    if engine_tokens is not None:  # the engine's batch of 8 through --tp 2 gives the single-process tokens
        single = build_torch_runner(SPECS[arch], weights(arch), kv_tokens=KV_TOKENS, block_size=BLOCK)
        assert engine_tokens == engine_outputs(single) and sum(map(len, engine_tokens)) >= 16


# -- pieces that need no processes ------------------------------------------------------------------
def test_wire_round_trip() -> None:
    batch = StepBatch([SeqChunk(7, [1, 2, 3], 0, [4, 9], LogitsWanted.ALL), SeqChunk(3, [5], 12, [0, 1, 2, 8]),
                       SeqChunk(9, [6, 6], 4, [2, 5], LogitsWanted.NONE)])  # fmt: skip
    got = decode(encode(batch))
    assert got == batch and encode(batch).dtype == torch.int64


def test_layout_grid_and_stages() -> None:
    c = ParallelConfig(tp=2, ep=2, pp=2)
    pos = RankPosition(c, 5, num_layers=5)
    assert (pos.stage, pos.expert_group, pos.tp_rank) == (1, 0, 1)
    assert pos.tp_group_ranks == [4, 5] and pos.stage_ranks == [4, 5, 6, 7] and pos.peer_in(0) == 1
    assert [list(stage_layers(5, 2, s)) for s in (0, 1)] == [[0, 1, 2], [3, 4]]


def test_ep_dispatch_choice() -> None:
    forced = ParallelConfig(ep=2, ep_dispatch="all_to_all")
    assert forced.ep_all_to_all(1, top_k=8) and not forced.ep_all_to_all(0, top_k=8)
    assert not ParallelConfig(ep=2, ep_dispatch="all_reduce").ep_all_to_all(4096, top_k=1)
    wide = ParallelConfig(ep=16)  # 16 ranks, top-2: all-to-all moves fewer bytes once the step is large
    assert wide.ep_all_to_all(4096, top_k=2) and not wide.ep_all_to_all(16, top_k=2)
    assert not ParallelConfig(ep=8).ep_all_to_all(4096, top_k=8)  # top-8 on 8 ranks: the all-reduce moves less
    with pytest.raises(PlanError, match="ep_dispatch 'nccl' is not one of auto, all_reduce, all_to_all"):
        ParallelConfig(ep=2, ep_dispatch="nccl")


@pytest.mark.parametrize(
    ("config", "message"),
    [(ParallelConfig(tp=3), "does not divide the model's 4 attention heads"),
     (ParallelConfig(ep=2), "needs a mixture-of-experts model"),
     (ParallelConfig(pp=4), "more stages than the model's 3 layers")],
)  # fmt: skip
def test_bad_splits_are_refused(config: ParallelConfig, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        config.check(SPECS["llama"])
    with pytest.raises(TwinferError, match="at least 1"):
        ParallelConfig(tp=0)


# -- the CLI: twinfer generate --tp/--ep/--pp -----------------------------------------------------
@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random Qwen3-MoE saved as a Hugging Face folder with a word-level tokenizer of its vocabulary."""
    pytest.importorskip("transformers")
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers

    from tests.fixtures_models import hf_model

    folder = tmp_path_factory.mktemp("moe")
    hf_model("qwen3_moe").save_pretrained(folder)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(96)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({}))
    return str(folder)


def _generate(folder: str, *flags: str) -> str:
    import subprocess
    import sys

    args = [sys.executable, "-m", "twinfer.cli.main", "generate", folder, "w5 w17 w3 w88 w41", "--backend", "torch",
            "-n", "8", "-t", "0", "--raw", "--threads", "2", *flags]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


@pytest.mark.parametrize("flags", [("--tp", "2"), pytest.param(("--ep", "2"), marks=pytest.mark.slow),
                                   pytest.param(("--pp", "2"), marks=pytest.mark.slow)])
def test_cli_generate_parallel_prints_the_single_process_text(moe_folder: str, flags: tuple[str, str]) -> None:
    single = _generate(moe_folder)
    assert single.strip()  # some text (the loop guard may stop a random model early)
    assert _generate(moe_folder, *flags) == single


def test_cli_refuses_a_split_the_model_cannot_take(moe_folder: str) -> None:
    import subprocess
    import sys

    args = [sys.executable, "-m", "twinfer.cli.main", "generate", moe_folder, "w1", "--backend", "torch", "--tp", "3"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "--tp 3 does not divide the model's 4 attention heads" in proc.stderr
