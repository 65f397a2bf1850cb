"""Hybrid linear attention with recurrent state: qwen3_next and qwen3_5_moe on torch and MLX.

- The two new Ops (`causal_conv1d`, `gated_delta`) on both backends against a plain numpy loop, over
  two sequences run in chunks, so the per-sequence states must carry across steps.
- Logits against transformers on tiny random configs (head counts, key/value head ratios, conv
  kernels, full-attention intervals, MoE on/off), prefill plus 8 decode steps, max |dlogit| <= 1e-4.
- The engine on torch: the state cannot be shared by prefix, so prefix reuse is off (a second
  request sharing a prefix gets the cold text), and preempted requests recompute from a zero state
  (text equal to each request alone). Speculation, which takes the state back: test_arch_hybrid_spec.py.
"""

from __future__ import annotations

import copy
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_arch_logits import BLOCK, DECODE_STEPS, PROMPT_A, PROMPT_B, TOL

from twinfer.runtime.batch import LogitsWanted, SeqChunk, StepBatch
from twinfer.runtime.engine import Engine, EngineConfig, GuardConfig, SamplingParams
from twinfer.runtime.errors import TwinferError
from twinfer.runtime.loaders import load_model
from twinfer.runtime.runner import OpsRunner
from twinfer.runtime.spec import LINEAR, LinearAttnSpec, ModelSpec

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
mx = pytest.importorskip("mlx.core")

from twinfer.backends.cuda.ops import TorchOps  # noqa: E402
from twinfer.backends.cuda.runner import build_torch_runner  # noqa: E402
from twinfer.backends.metal.ops import MlxOps  # noqa: E402
from twinfer.backends.metal.runner import build_mlx_runner  # noqa: E402

BASE = dict(vocab_size=128, hidden_size=64, max_position_embeddings=256, attn_implementation="eager")
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=20)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    # key heads < value heads (r = 2), odd value head size, conv kernel 3, full every 2nd layer
    "next-a": ("Qwen3Next", dict(MOE, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                                 linear_value_head_dim=12, linear_conv_kernel_dim=3, full_attention_interval=2,
                                 intermediate_size=48)),
    # r = 1, kernel 4, three linear layers then a full one, 8 query heads on 1 KV head, no experts
    "next-b": ("Qwen3Next", dict(num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=1, head_dim=8,
                                 linear_num_key_heads=4, linear_num_value_heads=4, linear_key_head_dim=8,
                                 linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=0,
                                 intermediate_size=48, norm_topk_prob=False)),
    # r = 3, kernel 2, half rotary, experts without renormalized top-k
    "next-c": ("Qwen3Next", dict(MOE, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2, head_dim=32,
                                 linear_num_key_heads=1, linear_num_value_heads=3, linear_key_head_dim=16,
                                 linear_value_head_dim=8, linear_conv_kernel_dim=2, norm_topk_prob=False,
                                 layer_types=["linear_attention", "full_attention", "linear_attention"],
                                 intermediate_size=48, partial_rotary_factor=0.5)),
    # Qwen3.5: separate in_proj_qkv/z/b/a, r = 2
    "q35-a": ("Qwen3_5Moe", dict(MOE, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                                 linear_value_head_dim=8, linear_conv_kernel_dim=4, full_attention_interval=2)),
}  # fmt: skip
BUILDERS = {"torch": build_torch_runner, "mlx": build_mlx_runner}
CONFIGS = {"Qwen3Next": "Qwen3NextConfig", "Qwen3_5Moe": "Qwen3_5MoeTextConfig"}


@cache
def hf_model(case: str) -> Any:
    """Random weights the way fixtures_models.random_causal_lm draws them (norms near 1, biases non-zero), for
    the case's classes, with matrices at std 0.1 (logits up to ~6) and decays A = exp(A_log) in (0.37, 2.7)."""
    prefix, kwargs = CASES[case]
    config = getattr(transformers, CONFIGS[prefix])(**{**BASE, **kwargs})
    torch.manual_seed(0)
    model = getattr(transformers, prefix + "ForCausalLM")(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.uniform_(-1.0, 1.0)
            elif "norm" in name:
                p.normal_(1.0, 0.1)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
            elif "embed_tokens" in name:
                p.normal_(0.0, 0.5)
            elif p.dim() >= 2:
                p.normal_(0.0, 0.1)
    return model


@cache
def reference(case: str) -> Any:
    """The case's transformers model in float64: its fp32 prefill runs the chunked delta rule, which rounds
    differently from the recurrent form; in float64 only twinfer's own error is measured."""
    model = copy.deepcopy(hf_model(case)).double()
    model.set_experts_implementation("eager")  # the grouped-GEMM experts take no float64
    return model


@cache
def saved(case: str, root: str) -> str:
    path = f"{root}/{case}"
    hf_model(case).save_pretrained(path)
    return path


def generate(runner: OpsRunner, seq: int, prompt: list[int], table: list[int]) -> tuple[np.ndarray, list[int]]:
    rows = [runner.step(StepBatch([SeqChunk(seq, prompt, 0, table, LogitsWanted.ALL)]))]
    new: list[int] = []
    for _ in range(DECODE_STEPS):
        new.append(int(rows[-1][-1].argmax()))
        rows.append(runner.step(StepBatch([SeqChunk(seq, [new[-1]], len(prompt) + len(new) - 1, table)])))
    return np.concatenate(rows), new


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("hybrid"))


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Any:
    """Tiny matrices: torch's thread pool only adds waits (on a loaded 2-core host, 10x a step's time)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("backend", sorted(BUILDERS))
@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case: str, backend: str, root: str) -> None:
    loaded = load_model(saved(case, root))
    weights = {name: loaded.weights.load(name) for name in loaded.weights.names()}
    runner = BUILDERS[backend](loaded.spec, weights, kv_tokens=64 * BLOCK, block_size=BLOCK)
    worst = 0.0
    for seq, (prompt, first) in enumerate(((PROMPT_A, 0), (PROMPT_B, 30))):
        rows, new = generate(runner, seq, prompt, [first + 3 * i for i in range(8)])
        with torch.no_grad():
            ref = reference(case)(torch.tensor([prompt + new])).logits[0].numpy()[: len(rows)]
        worst = max(worst, float(np.abs(rows - ref).max()))
    print(f"{case} {backend}: max |dlogit| = {worst:.2e}")
    assert worst <= TOL


def test_specs_from_configs(root: str) -> None:
    spec = load_model(saved("next-a", root)).spec
    assert spec.layer_types == (LINEAR, "full_attention") * 2
    assert spec.linear_attn == LinearAttnSpec(2, 4, 8, 12, 3)
    assert spec.rotary_dim == 4 and spec.moe is not None and spec.moe.shared_intermediate_size == 20
    # two linear layers: conv (K-1) x 80 channels x 4 bytes + fp32 delta 4 x 8 x 12 x 4 bytes, per sequence
    assert spec.state_bytes_per_seq(4.0) == 2 * (2 * 80 * 4 + 4 * 8 * 12 * 4)
    assert spec.kv_bytes_per_token(4.0) == 2 * 2 * 32 * 4  # only the two full layers hold KV


# -- the ops against a plain reference --------------------------------------------------------------
def conv_reference(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x [T, Ch] of one whole sequence, w [Ch, K] -> [T, Ch]."""
    K = w.shape[1]
    padded = np.concatenate([np.zeros((K - 1, x.shape[1]), x.dtype), x])
    return sum(padded[j : j + len(x)] * w[:, j] for j in range(K))  # type: ignore[return-value]


def delta_reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, a: np.ndarray, b: np.ndarray, decay: np.ndarray,
                    dt_bias: np.ndarray) -> np.ndarray:
    """The gated delta rule token by token over one whole sequence (float64), as Ops.gated_delta states it."""
    T, Hv, Dv = v.shape
    rep = Hv // q.shape[1]

    def unit(x: np.ndarray) -> np.ndarray:
        return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)

    q = np.repeat(unit(q), rep, axis=1) * q.shape[-1] ** -0.5
    k = np.repeat(unit(k), rep, axis=1)
    g = decay * np.log1p(np.exp(a + dt_bias))
    beta = 1 / (1 + np.exp(-b))
    S = np.zeros((Hv, q.shape[-1], Dv))
    out = np.zeros((T, Hv, Dv))
    for t in range(T):
        S = S * np.exp(g[t])[:, None, None]
        delta = (v[t] - np.einsum("hkv,hk->hv", S, k[t])) * beta[t][:, None]
        S = S + k[t][:, :, None] * delta[:, None, :]
        out[t] = np.einsum("hkv,hk->hv", S, q[t])
    return out


def _spec(la: LinearAttnSpec) -> ModelSpec:
    return ModelSpec(model_type="qwen3_next", vocab_size=8, hidden_size=8, num_layers=1, num_heads=1, num_kv_heads=1,
                     head_dim=8, intermediate_size=8, layer_types=(LINEAR,), linear_attn=la)


def _run_ops(ops: Any, to: Any, steps: list[list[tuple[int, int, int]]], data: dict[str, np.ndarray],
             w: np.ndarray, decay: np.ndarray, dt_bias: np.ndarray) -> dict[int, list[np.ndarray]]:
    """Each step: chunks (seq, start, end) of per-sequence data; returns each sequence's (conv, delta) outputs."""
    out: dict[int, list[Any]] = {}
    for chunks in steps:
        batch = StepBatch([SeqChunk(s, [0] * (e - st), st, list(range(64))) for s, st, e in chunks])
        ctx = ops.begin_step(batch)

        def cat(key: str, chunks: list[tuple[int, int, int]] = chunks) -> Any:
            return to(np.concatenate([data[key][s][st:e] for s, st, e in chunks]))

        conv = ops.causal_conv1d(cat("x"), to(w), ctx, 0)
        delta = ops.gated_delta(cat("q"), cat("k"), cat("v"), cat("a"), cat("b"), to(decay), to(dt_bias), ctx, 0)
        conv, delta = np.asarray(ops.to_host(conv)), np.asarray(ops.to_host(delta))
        offset = 0
        for s, st, e in chunks:
            n = e - st
            out.setdefault(s, []).append((conv[offset : offset + n], delta[offset : offset + n]))
            offset += n
    return {s: [np.concatenate([c for c, _ in parts]), np.concatenate([d for _, d in parts])] for s, parts in out.items()}


@pytest.mark.parametrize("heads,kernel", [((2, 4), 4), ((1, 3), 2), ((2, 2), 1)])
def test_ops_match_reference(heads: tuple[int, int], kernel: int) -> None:
    Hk, Hv = heads
    la = LinearAttnSpec(Hk, Hv, 8, 6, kernel)
    rng = np.random.default_rng(0)
    lengths = {0: 13, 1: 9}
    data: dict[str, dict[int, np.ndarray]] = {key: {} for key in "xqkvab"}
    for s, T in lengths.items():
        data["x"][s] = rng.standard_normal((T, la.conv_dim)).astype(np.float32)
        data["q"][s] = rng.standard_normal((T, Hk, 8)).astype(np.float32)
        data["k"][s] = rng.standard_normal((T, Hk, 8)).astype(np.float32)
        data["v"][s] = rng.standard_normal((T, Hv, 6)).astype(np.float32)
        data["a"][s] = rng.standard_normal((T, Hv)).astype(np.float32)
        data["b"][s] = rng.standard_normal((T, Hv)).astype(np.float32)
    w = rng.standard_normal((la.conv_dim, kernel)).astype(np.float32)
    decay, dt_bias = -rng.uniform(0.1, 4, Hv).astype(np.float32), rng.standard_normal(Hv).astype(np.float32)
    # sequence 0: chunks of 5 and 6, then two decode steps; sequence 1 joins in the second step
    steps = [[(0, 0, 5)], [(0, 5, 11), (1, 0, 7)], [(0, 11, 12), (1, 7, 8)], [(1, 8, 9), (0, 12, 13)]]
    backends = {"torch": (TorchOps(_spec(la), num_blocks=64, block_size=1), lambda a: torch.from_numpy(a)),
                "mlx": (MlxOps(_spec(la), num_blocks=64, block_size=1), mx.array)}
    got = {name: _run_ops(ops, to, steps, data, w, decay, dt_bias) for name, (ops, to) in backends.items()}
    for s in lengths:
        d = {key: data[key][s].astype(np.float64) for key in data}
        conv_ref = conv_reference(d["x"], w.astype(np.float64))
        delta_ref = delta_reference(d["q"], d["k"], d["v"], d["a"], d["b"], decay, dt_bias)
        for name in backends:
            conv, delta = got[name][s]
            assert np.abs(conv - conv_ref).max() < 1e-5, (name, s)
            assert np.abs(delta - delta_ref).max() < 1e-5, (name, s)
        assert np.abs(got["torch"][s][1] - got["mlx"][s][1]).max() < 1e-5


# -- the engine -------------------------------------------------------------------------------------
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, guard=GuardConfig(enabled=False))


@cache
def _weights(root: str) -> tuple[ModelSpec, dict[str, np.ndarray]]:
    loaded = load_model(saved("next-a", root))
    return loaded.spec, {name: loaded.weights.load(name) for name in loaded.weights.names()}


def engine(root: str, kv_tokens: int = 512, proposer: Any = None, **config: Any) -> Engine:
    spec, weights = _weights(root)
    runner = build_torch_runner(spec, weights, kv_tokens=kv_tokens, block_size=BLOCK)
    return Engine(runner, None, EngineConfig(**config), proposer=proposer)


@cache
def _alone_engine(root: str) -> Engine:
    return engine(root)


def alone(root: str, prompt: list[int]) -> list[int]:
    """The prompt's greedy tokens run by itself (on an engine that never reuses a prefix of a recurrent model)."""
    return _alone_engine(root).generate([prompt], GREEDY)[0].token_ids


def test_shared_prefix_is_recomputed(root: str) -> None:
    base = PROMPT_A * 2
    e = engine(root)
    first = e.generate([base + [1, 2]], GREEDY)[0]
    second = e.generate([base + [4]], GREEDY)[0]  # shares 22 tokens (5 blocks) with the first
    assert second.cached_tokens == 0, "a recurrent model must not start from a cached prefix"
    assert second.token_ids == alone(root, base + [4])
    assert first.token_ids == alone(root, base + [1, 2])
    assert e.runner.torch_ops.states.slots.held == 0, "finished sequences give their state slots back"


def test_preempted_requests_equal_alone(root: str) -> None:
    prompts = [PROMPT_A, PROMPT_B, PROMPT_B[::-1] + PROMPT_A[:3], PROMPT_A[4:], [8, 6, 7, 5, 3, 0, 9]]
    e = engine(root, kv_tokens=BLOCK * 12, max_batch_tokens=32, max_seqs=5)
    outs = e.generate(prompts, GREEDY)
    assert e.scheduler.preemptions > 0, "the pool was meant to force preemption"
    for p, out in zip(prompts, outs, strict=True):
        assert out.token_ids == alone(root, p)
    assert e.blocks.num_used == 0 and e.runner.torch_ops.states.slots.held == 0


# -- GGUF: llama.cpp's converter and runner -----------------------------------------------------------
# llama.cpp runs delta nets whose key and value heads have one size; Qwen3.5's interleaved mrope needs
# sections that fit the rotated dims (8 here: 2 + 1 + 1 pairs)
GGUF_BASE = dict(vocab_size=320, hidden_size=64, max_position_embeddings=512, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
                 linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                 full_attention_interval=2, **MOE)
GGUF_CASES = {
    "qwen3_next": ("Qwen3Next", dict(GGUF_BASE, intermediate_size=48)),
    "qwen3_5_moe": ("Qwen3_5Moe", dict(GGUF_BASE, rope_parameters=dict(
        rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25, mrope_section=[2, 1, 1],
        mrope_interleaved=True))),
}
QWEN_CHAT = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
             "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@cache
def gguf_file(case: str, root: str) -> str:
    from gguf_convert import FAMILIES, convert, save_tiny_tokenizer

    FAMILIES.setdefault("qwen", (("<|endoftext|>", "<|im_start|>", "<|im_end|>"), "<|im_end|>", QWEN_CHAT))
    CASES[case] = GGUF_CASES[case]  # hf_model builds it like the logits cases
    folder = f"{root}/{case}-gguf"
    hf_model(case).save_pretrained(folder)
    save_tiny_tokenizer(Path(folder), "qwen")
    return str(convert(Path(folder), Path(f"{folder}.gguf"), args=("--no-mtp",)))


@pytest.mark.parametrize("case", ["qwen3_next", pytest.param("qwen3_5_moe", marks=pytest.mark.slow)])
def test_gguf_graph_matches_llamacpp(case: str, root: str) -> None:
    pytest.importorskip("llama_cpp")
    from twinfer.app.models import open_model
    from twinfer.quant.fidelity import RunnerSource, corpus_windows
    from twinfer.quant.kl import KLAccumulator

    path = gguf_file(case, root)
    spec = load_model(path).spec
    assert spec.model_type == case and spec.layer_types == (LINEAR, "full_attention") * 2
    llama_runner = open_model(path, "llamacpp", max_seqs=1, ctx=256).runner
    assert llama_runner.kv.recurrent, "llama.cpp's runner must declare the recurrent state"
    llama, ours = RunnerSource(llama_runner), RunnerSource(open_model(path, "torch", max_seqs=1, ctx=256).runner)
    acc = KLAccumulator()
    for window in corpus_windows(path, "prose", 128, 64):
        ref = llama.logits(window)[:-1]
        assert float(ref.std()) > 0.5  # logits that can disagree
        acc.add(ref, ours.logits(window)[:-1])
    report = acc.report("llamacpp", "torch", "prose")
    print(f"{case} GGUF: mean KL {report.mean_kl:.2e}, max {report.max_kl:.2e}, top-1 {report.top1_agreement:.3f}")
    assert report.mean_kl <= 0.01 and report.top1_agreement >= 0.94, report


def test_gguf_engine_text_two_concurrent_equals_alone(root: str) -> None:
    """On llama.cpp's runner: two requests sharing a prefix, run together, give the text each gives alone and
    the torch graph's text; no prefix is reused (cached_tokens 0) and a proposer is refused."""
    pytest.importorskip("llama_cpp")
    from twinfer.app.models import open_model
    from twinfer.runtime.speculative.ngram import NgramProposer

    path = gguf_file("qwen3_next", root)
    prompts = ["The quick brown fox jumps over", "The quick brown fox sleeps"]
    texts = {}
    for backend in ("llamacpp", "torch"):
        opened = open_model(path, backend, max_seqs=2, ctx=256)
        e = Engine(opened.runner, opened.tokenizer, EngineConfig(max_seqs=2))
        together = e.generate(prompts, GREEDY)
        alone_ = [e.generate([p], GREEDY)[0] for p in prompts]
        assert [o.text for o in together] == [o.text for o in alone_], backend
        assert all(o.cached_tokens == 0 for o in together + alone_)
        texts[backend] = [o.text for o in together]
        if backend == "llamacpp":
            with pytest.raises(TwinferError, match="speculative decoding is off"):
                Engine(opened.runner, opened.tokenizer, EngineConfig(max_seqs=2), proposer=NgramProposer())
    assert texts["llamacpp"] == texts["torch"] and all(t.strip() for t in texts["torch"]), texts


# -- the planner ----------------------------------------------------------------------------------
def test_catalog_counts_state_per_sequence() -> None:
    from twinfer.planners.catalog import find
    from twinfer.planners.cost import kv_shard
    from twinfer.planners.hardware import Cluster
    from twinfer.planners.hw_table import DEVICES
    from twinfer.planners.memory import memory_for
    from twinfer.planners.plan import make_plan
    from twinfer.planners.search import Request

    entry = find("qwen3-next-80b-a3b")
    spec = entry.spec
    # 36 delta-net layers: conv 3 x 8192 channels x 2 bytes + fp32 state 32 heads x 128 x 128 x 4 bytes
    assert spec.state_bytes_per_seq() == 36 * (3 * 8192 * 2 + 32 * 128 * 128 * 4) == 77_266_944
    assert spec.kv_bytes_per_token(2) == 12 * 2 * 2 * 256 * 2 == 24576  # only the 12 full layers hold KV
    assert abs(entry.profile().total_params / 1e9 - 79.67) < 0.01  # the published 80B
    assert abs(find("qwen3.5-397b-a17b").profile().total_params / 1e9 - 396.35) < 0.01
    assert abs(find("qwen3.5-35b-a3b").profile().total_params / 1e9 - 34.66) < 0.01

    cluster = Cluster(DEVICES["h200"], 2)
    plan = make_plan(entry.profile(), cluster, Request(4096, 1, "auto", "bf16"))
    assert plan.fits

    def kv(context: int, seqs: int) -> float:
        """KV and state bytes of `seqs` sequences on one replica (all its shards), under the plan's strategy."""
        s = plan.chosen.strategy
        return memory_for(entry.profile(), cluster, s, seqs * s.dp, context).kv * kv_shard(entry.profile(), s)

    # doubling the context adds tokens' KV only; a second sequence adds its state once more
    assert kv(8192, 1) - kv(4096, 1) == pytest.approx(4096 * 24576, rel=1e-9)
    assert kv(4096, 2) - kv(4096, 1) == pytest.approx(4096 * 24576 + 77_266_944, rel=1e-9)
