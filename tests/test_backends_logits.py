"""The torch and MLX backends against Hugging Face transformers: fp32 logits on tiny random models.

Each architecture is built from a config (no download) with weights drawn at a scale that gives
O(1) logits. Both backends must match transformers to 1e-4 on a prefill and on 8 greedy decode
steps through the paged KV cache, and a batched run (two sequences of different lengths, a chunked
prefill, decode mixed with prefill) must give the rows of the separate runs.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from twinfer.runtime.batch import LogitsWanted, SeqChunk, StepBatch
from twinfer.runtime.runner import OpsRunner
from twinfer.runtime.spec import FULL, SLIDING, ModelSpec, MoESpec

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
mx = pytest.importorskip("mlx.core")

from twinfer.backends.cuda.runner import build_torch_runner  # noqa: E402
from twinfer.backends.metal.runner import build_mlx_runner  # noqa: E402

TOL = 1e-4  # absolute, against transformers
BATCH_RTOL = 2e-6  # batched against separate steps, relative to the largest logit: fp32 summation order
DECODE_STEPS = 8
BLOCK = 4  # small blocks, so every sequence spans several non-contiguous blocks
KV_TOKENS = 64 * BLOCK
VOCAB, HIDDEN = 128, 64
PROMPT_A = [3, 17, 99, 5, 64, 120, 8, 41, 77, 2, 56]  # 11 tokens: longer than Gemma's window of 4
PROMPT_B = [9, 33, 101, 7, 60]

COMMON = dict(
    vocab_size=VOCAB, hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=256, attn_implementation="eager",
)  # fmt: skip
ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("Llama", dict(
        intermediate_size=96, num_hidden_layers=2,
        rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=64),
    )),
    "qwen2": ("Qwen2", dict(intermediate_size=96, num_hidden_layers=2)),  # q/k/v biases
    "qwen3": ("Qwen3", dict(intermediate_size=96, num_hidden_layers=2, head_dim=32, tie_word_embeddings=True)),
    "gemma3": ("Gemma3", dict(
        intermediate_size=96, num_hidden_layers=3, num_key_value_heads=1, head_dim=32, sliding_window=4,
        layer_types=[SLIDING, FULL, SLIDING], query_pre_attn_scalar=24,
    )),
    "qwen3_moe": ("Qwen3Moe", dict(
        intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2, head_dim=16, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=False,
    )),
    "mixtral": ("Mixtral", dict(intermediate_size=32, num_hidden_layers=2, num_local_experts=8,
                                num_experts_per_tok=2)),
}  # fmt: skip

BUILDERS: dict[str, Callable[..., OpsRunner]] = {"torch": build_torch_runner, "mlx": build_mlx_runner}


# -- the reference model and its canonical form ---------------------------------------------------
@cache
def hf_model(arch: str) -> Any:
    prefix, kwargs = ARCHS[arch]
    config_cls = getattr(transformers, prefix + ("TextConfig" if arch == "gemma3" else "Config"))
    model_cls = getattr(transformers, prefix + "ForCausalLM")
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**COMMON, **kwargs})).eval()
    _randomize(model, gemma=arch == "gemma3")
    return model


def _randomize(model: Any, gemma: bool) -> None:
    """Redraw every weight so logits are O(1) and norms, biases and routers all matter."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0 if gemma else 1.0, 0.3 if gemma else 0.1)  # Gemma stores w - 1
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
            elif "embed_tokens" in name:
                p.normal_(0.0, 0.5)
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5)  # the last axis is the input features


_SAVED: dict[str, Any] = {}


@cache
def canonical(arch: str) -> tuple[ModelSpec, dict[str, np.ndarray]]:
    """The model as twinfer loads it: save_pretrained (fp32 safetensors), then `load_model`."""
    import tempfile

    from twinfer.runtime.loaders import load_model

    folder = _SAVED.setdefault("root", tempfile.TemporaryDirectory())
    path = Path(folder.name) / arch
    hf_model(arch).save_pretrained(path)
    loaded = load_model(path)
    return loaded.spec, {name: loaded.weights.load(name) for name in loaded.weights.names()}


@cache
def hf_logits(arch: str, tokens: tuple[int, ...]) -> np.ndarray:
    with torch.no_grad():
        return hf_model(arch)(torch.tensor([tokens])).logits[0].float().numpy()


# -- driving a runner ---------------------------------------------------------------------------
def blocks(first: int, n: int = 8) -> list[int]:
    """A non-contiguous block table: every third block from `first`."""
    return [first + 3 * i for i in range(n)]


def step(runner: OpsRunner, *chunks: SeqChunk) -> np.ndarray:
    return runner.step(StepBatch(list(chunks)))


def generate(
    runner: OpsRunner, seq: int, prompt: list[int], table: list[int]
) -> tuple[np.ndarray, list[int]]:
    """Prefill (all rows) then DECODE_STEPS greedy steps; returns every row and the new tokens."""
    rows = [step(runner, SeqChunk(seq, prompt, 0, table, LogitsWanted.ALL))]
    new: list[int] = []
    for _ in range(DECODE_STEPS):
        new.append(int(rows[-1][-1].argmax()))
        rows.append(step(runner, SeqChunk(seq, [new[-1]], len(prompt) + len(new) - 1, table)))
    return np.concatenate(rows), new


def batched(runner: OpsRunner, a_new: list[int], b_new: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """A and B together: a chunked prefill of B, decode mixed with prefill, then batched decode."""
    ta, tb = blocks(2), blocks(1)  # interleaved with each other and with the separate runs' blocks
    nA, nB = len(PROMPT_A), len(PROMPT_B)
    a_rows, b_rows = [], []
    out = step(runner, SeqChunk(10, PROMPT_A, 0, ta, LogitsWanted.ALL),
               SeqChunk(11, PROMPT_B[:2], 0, tb, LogitsWanted.NONE))  # fmt: skip
    a_rows.append(out)
    out = step(runner, SeqChunk(10, [a_new[0]], nA, ta), SeqChunk(11, PROMPT_B[2:], 2, tb, LogitsWanted.ALL))
    a_rows.append(out[:1])
    b_rows.append(out[1:])
    for i in range(3):
        out = step(runner, SeqChunk(10, [a_new[i + 1]], nA + 1 + i, ta), SeqChunk(11, [b_new[i]], nB + i, tb))
        a_rows.append(out[:1])
        b_rows.append(out[1:])
    return np.concatenate(a_rows), np.concatenate(b_rows)


# -- tests ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", sorted(BUILDERS))
@pytest.mark.parametrize("arch", list(ARCHS))
def test_logits_match_transformers(arch: str, backend: str) -> None:
    spec, weights = canonical(arch)
    runner = BUILDERS[backend](spec, weights, kv_tokens=KV_TOKENS, block_size=BLOCK)

    a_rows, a_new = generate(runner, 0, PROMPT_A, blocks(0))
    b_rows, b_new = generate(runner, 1, PROMPT_B, blocks(30))
    ref_a = hf_logits(arch, tuple(PROMPT_A + a_new))[: len(a_rows)]
    ref_b = hf_logits(arch, tuple(PROMPT_B + b_new))[: len(b_rows)]
    nA = len(PROMPT_A)
    assert np.abs(a_rows[:nA] - ref_a[:nA]).max() <= TOL, "prefill"
    assert np.abs(a_rows[nA:] - ref_a[nA:]).max() <= TOL, "decode"
    assert np.abs(b_rows - ref_b).max() <= TOL, "second sequence"

    got_a, got_b = batched(runner, a_new, b_new)
    want_a = a_rows[: len(got_a)]
    want_b = b_rows[2 : 2 + len(got_b)]  # B's rows from position 2, where its second chunk starts
    scale = np.abs(want_a).max()
    assert np.abs(got_a - want_a).max() <= BATCH_RTOL * scale, "batched A"
    assert np.abs(got_b - want_b).max() <= BATCH_RTOL * scale, "batched B"


@pytest.mark.parametrize("tokens", [5, 48])  # 48 tokens * top-2 takes the sorted gather_mm path
@pytest.mark.parametrize("renorm", [True, False])
def test_mlx_moe_matches_torch(tokens: int, renorm: bool) -> None:
    from twinfer.backends.cuda.ops import TorchOps
    from twinfer.backends.metal.ops import MlxOps

    E, inter, C = 8, 24, 32
    moe = MoESpec(num_experts=E, top_k=2, expert_intermediate_size=inter, norm_topk_prob=renorm)
    spec = ModelSpec("qwen3_moe", VOCAB, C, 1, 2, 1, 16, 64, moe=moe)
    rng = np.random.default_rng(1)
    x, router = rng.normal(size=(tokens, C)), rng.normal(size=(E, C)) * C**-0.5
    gate, up = (rng.normal(size=(E, inter, C)) * C**-0.5 for _ in range(2))
    down = rng.normal(size=(E, C, inter)) * inter**-0.5
    args = [a.astype(np.float32) for a in (x, router, gate, up, down)]
    t, m = TorchOps(spec, num_blocks=1, block_size=4), MlxOps(spec, num_blocks=1, block_size=4)
    tx, tr, tg, tu, td = (t.weight("", a) for a in args)
    mx_, mr, mg, mu, md = (m.weight("", a) for a in args)
    want = t.to_host(t.moe(tx, tr, tg, tu, td, moe, "silu"))
    got = m.to_host(m.moe(mx_, mr, mg, mu, md, moe, "silu"))
    assert np.abs(got - want).max() <= 1e-5


@pytest.mark.parametrize("backend", sorted(BUILDERS))
def test_bfloat16_stays_close_to_float32(backend: str) -> None:
    """The half-precision paths (casts, the plain RMSNorm) run and stay near the float32 logits."""
    spec, weights = canonical("qwen3_moe")
    half = {"torch": torch.bfloat16, "mlx": "bfloat16"}[backend]
    rows = {}
    for dtype in (half, {"torch": torch.float32, "mlx": "float32"}[backend]):
        runner = BUILDERS[backend](spec, weights, kv_tokens=KV_TOKENS, block_size=BLOCK, dtype=dtype)
        rows[dtype] = generate(runner, 0, PROMPT_A, blocks(0))[0][: len(PROMPT_A) + 1]
    got, want = rows.values()
    assert got.dtype == np.float32
    assert np.abs(got - want).max() <= 0.05 * np.abs(want).max()


def test_mlx_fast_kernels_match_plain_ops() -> None:
    """mx.fast.rms_norm (used for float32) against the plain formula; gelu_tanh against torch."""
    from twinfer.backends.metal.ops import MlxOps, rms_norm_reference

    rng = np.random.default_rng(2)
    x = mx.array((rng.normal(size=(64, 4, 128)) * 3).astype(np.float32))
    w = mx.array(rng.normal(size=128).astype(np.float32))
    diff = mx.abs(mx.fast.rms_norm(x, w, 1e-6) - rms_norm_reference(x, w, 1e-6)).max()
    assert diff.item() <= 1e-6

    spec = ModelSpec("llama", VOCAB, 32, 1, 2, 1, 16, 64)
    values = np.linspace(-8, 8, 4001, dtype=np.float32)
    got = np.array(MlxOps(spec, num_blocks=1, block_size=4).act(mx.array(values), "gelu_tanh"))
    want = torch.nn.functional.gelu(torch.from_numpy(values), approximate="tanh").numpy()
    assert np.abs(got - want).max() <= 1e-6
