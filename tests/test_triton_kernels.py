"""Triton kernels against their torch references, run by triton's interpreter on CPU.

TRITON_INTERPRET must be set before the kernel modules are imported: triton 3.x picks the
interpreter when `@triton.jit` decorates a function.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")
torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from twinfer.backends.cuda.kernels.fp8_gemm import fp8_weight_gemm  # noqa: E402
from twinfer.backends.cuda.kernels.fused_moe import align_by_expert, fused_moe  # noqa: E402
from twinfer.backends.cuda.kernels.paged_attention import DecodeTiles, paged_decode_attention  # noqa: E402
from twinfer.backends.cuda.kernels.reference import (  # noqa: E402
    fused_moe_ref,
    paged_decode_attention_ref,
    rms_norm_residual_ref,
)
from twinfer.backends.cuda.kernels.rmsnorm import rms_norm, rms_norm_residual  # noqa: E402
from twinfer.backends.cuda.kernels.rope import rope, rope_applies  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


def test_rms_norm_residual_matches_reference() -> None:
    g = torch.Generator().manual_seed(0)
    x, r = (torch.randn(5, 96, generator=g) * 3 for _ in range(2))  # C not a power of two: masked tail
    w = torch.randn(96, generator=g)
    y, h = rms_norm_residual(x.to(DEVICE), r.to(DEVICE), w.to(DEVICE), 1e-6)
    y_ref, h_ref = rms_norm_residual_ref(x, r, w, 1e-6)
    assert torch.equal(h.cpu(), h_ref)
    assert (y.cpu() - y_ref).abs().max() <= 1e-5


@pytest.mark.parametrize("splits", [1, 3, None])
@pytest.mark.parametrize("window", [None, 5])
def test_paged_decode_attention_matches_reference(window: int | None, splits: int | None) -> None:
    """Grouped query heads (4 per KV head), a context split 1 or 3 ways or by the shapes (None)."""
    g = torch.Generator().manual_seed(1)
    B, H, Hkv, D, bs = 3, 8, 2, 16, 4
    num_blocks = 36
    k_cache = torch.randn(num_blocks * bs, Hkv, D, generator=g)
    v_cache = torch.randn(num_blocks * bs, Hkv, D, generator=g)
    tables = torch.randperm(num_blocks, generator=g)[:30].view(B, 10)  # scattered, non-contiguous blocks
    lens = torch.tensor([1, 13, 37])  # one position, a partial block, more than two BLOCK_N runs
    q = torch.randn(B, H, D, generator=g)
    args = (k_cache, v_cache, tables, lens, bs, D**-0.5, window)
    got = paged_decode_attention(q.to(DEVICE), *(a.to(DEVICE) if torch.is_tensor(a) else a for a in args),
                                 tiles=DecodeTiles(block_n=16, splits=splits))
    want = paged_decode_attention_ref(q, *args)
    assert (got.cpu() - want).abs().max() <= 1e-5


HALF = [torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])  # the interpreter misreads bf16 dots


@pytest.mark.parametrize("dtype", HALF)
def test_paged_decode_attention_in_half_precision_stays_near_float(dtype: torch.dtype) -> None:
    """16-bit caches: the probabilities enter the value product in 16 bits, as flash attention's do."""
    g = torch.Generator().manual_seed(3)
    B, H, Hkv, D, bs = 2, 4, 1, 32, 16
    k_cache, v_cache = (torch.randn(8 * bs, Hkv, D, generator=g) for _ in range(2))
    tables, lens, q = torch.arange(8).view(B, 4), torch.tensor([50, 64]), torch.randn(B, H, D, generator=g)
    want = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, bs, D**-0.5)
    got = paged_decode_attention(*(a.to(DEVICE, dtype) for a in (q, k_cache, v_cache)),
                                 tables.to(DEVICE), lens.to(DEVICE), bs, D**-0.5, tiles=DecodeTiles(splits=2))
    assert (got.float().cpu() - want).abs().max() <= 2e-2


@pytest.mark.parametrize("rows,splits", [(1, 1), (5, 3), (16, None), (40, 2)])
def test_fp8_weight_gemm_matches_the_dequantized_product(rows: int, splits: int | None) -> None:
    """N and K not multiples of the tiles; K split 1 or 3 ways or by the shapes (None)."""
    from twinfer.backends.cuda.formats import Fp8Linear

    g = torch.Generator().manual_seed(5)
    N, K = 72, 400
    w = Fp8Linear.from_weight(torch.randn(N, K, generator=g))
    x = torch.randn(rows, K, generator=g)
    got = fp8_weight_gemm(x.to(DEVICE), w.codes.to(DEVICE), w.scale.to(DEVICE), block_k=64, splits=splits)
    want = x @ w.dequantize().t()
    assert got.shape == (rows, N)
    assert (got.cpu() - want).abs().max() <= 1e-4 * want.abs().max()


@pytest.mark.parametrize("D,R", [(32, 32), (48, 16)])  # full rotary; partial (dims past R pass through)
def test_rope_matches_the_torch_rotation(D: int, R: int) -> None:
    from twinfer.backends.cuda.ops import TorchOps

    g = torch.Generator().manual_seed(6)
    T, H = 5, 6  # H not a power of two: masked rows
    qkv = torch.randn(T, H + 4, D, generator=g)
    x = qkv[:, 2 : 2 + H]  # a strided view, as a fused projection's split gives
    freqs = torch.arange(T).float()[:, None] * (10000.0 ** (-torch.arange(R // 2).float() / (R // 2)))
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    cos, sin = emb.cos(), emb.sin()
    assert rope_applies(x, R)
    got = rope(x.to(DEVICE), cos.to(DEVICE), sin.to(DEVICE)).cpu()
    rot = TorchOps._rotate(x[..., :R], cos, sin)
    want = torch.cat((rot, x[..., R:]), dim=-1)
    assert (got - want).abs().max() <= 1e-6
    assert not rope_applies(x, 24)  # a half width of 12 does not tile: the torch form runs


def test_align_by_expert_pads_each_expert_to_a_block() -> None:
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]])
    pairs, experts = align_by_expert(ids, num_experts=4, block_m=2)
    # expert 2 has 3 pairs: two blocks; expert 3 none. The length is fixed by the shapes (3 + 4 blocks):
    # the trailing blocks hold only padding (6 = T*k), so dispatch never reads a count back from the device
    assert experts.tolist() == [0, 1, 2, 2, 3, 3, 3]
    assert pairs.tolist() == [1, 4, 3, 6, 0, 2, 5] + [6] * 7


def test_align_by_expert_keeps_only_the_held_experts() -> None:
    ids = torch.tensor([[2, 0], [2, 1], [0, 3]])
    pairs, experts = align_by_expert(ids, num_experts=2, block_m=2, first=2)  # this rank holds experts 2, 3
    assert experts.tolist()[:2] == [0, 1] and pairs.tolist()[:4] == [0, 2, 5, 6]
    assert set(pairs.tolist()[4:]) == {6}


def test_rms_norm_without_residual_matches_reference() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 4, 24, generator=g) * 2  # per-head norm over the last axis of [T, H, D]
    w = torch.randn(24, generator=g)
    y_ref, _ = rms_norm_residual_ref(x, torch.zeros_like(x), w, 1e-6)
    assert (rms_norm(x.to(DEVICE), w.to(DEVICE), 1e-6).cpu() - y_ref).abs().max() <= 1e-5


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_fused_moe_matches_reference(act: str) -> None:
    g = torch.Generator().manual_seed(2)
    T, C, inter, E, k = 21, 48, 40, 6, 2  # sizes that are not multiples of the tile sizes
    x = torch.randn(T, C, generator=g)
    gate, up = (torch.randn(E, inter, C, generator=g) * C**-0.5 for _ in range(2))
    down = torch.randn(E, C, inter, generator=g) * inter**-0.5
    probs = torch.randn(T, E, generator=g).softmax(-1)
    weights, ids = probs.topk(k, dim=-1)
    ids[0] = torch.tensor([5, 4])  # make sure rarely picked experts appear
    args = (x, gate, up, down, ids, weights)
    got = fused_moe(*(a.to(DEVICE) for a in args), act=act)
    want = fused_moe_ref(*args, act=act)
    assert (got.cpu() - want).abs().max() <= 1e-4


def test_fused_moe_adds_only_the_experts_held_here() -> None:
    g = torch.Generator().manual_seed(4)
    T, C, inter, E, k = 9, 32, 16, 4, 2
    x = torch.randn(T, C, generator=g)
    gate, up = (torch.randn(E, inter, C, generator=g) * C**-0.5 for _ in range(2))
    down = torch.randn(E, C, inter, generator=g) * inter**-0.5
    weights, ids = torch.randn(T, E, generator=g).softmax(-1).topk(k, dim=-1)
    args = (x, gate, up, down, ids, weights)
    halves = [fused_moe(x.to(DEVICE), gate[a:a + 2].to(DEVICE), up[a:a + 2].to(DEVICE), down[a:a + 2].to(DEVICE),
                        ids.to(DEVICE), weights.to(DEVICE), first=a).cpu() for a in (0, 2)]  # two EP ranks
    assert (halves[0] + halves[1] - fused_moe_ref(*args)).abs().max() <= 1e-4
    assert halves[0].abs().max() > 0 and halves[1].abs().max() > 0


# -- whole models through the kernels (TorchOps(kernels="triton")) against the plain-torch path ----------
@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_models_through_the_kernels_match_the_torch_path(arch: str) -> None:
    """Prefill (SDPA) then decode steps (paged-attention kernel), every norm and MoE layer through triton."""
    from tests.test_parallel import SPECS, reference, weights, workload
    from twinfer.backends.cuda.runner import build_torch_runner

    runner = build_torch_runner(SPECS[arch], weights(arch), kv_tokens=256, block_size=4, kernels="triton",
                                cuda_graphs=False, device=DEVICE)
    k = runner.torch_ops._k
    calls = {"paged_decode_attention": 0, "fused_moe": 0, "rms_norm_residual": 0, "rope": 0}
    for name in calls:  # count the launches, so a silent fallback to torch fails the test
        fn = getattr(k, name)
        setattr(k, name, lambda *a, _fn=fn, _name=name, **kw: (calls.__setitem__(_name, calls[_name] + 1),
                                                                _fn(*a, **kw))[1])
    got_rows, got_tokens = workload(runner)
    want_rows, want_tokens = reference(arch)
    assert runner.torch_ops.kernels == "triton" and runner.describe()["kernels"] == "triton"
    assert np.abs(got_rows - want_rows).max() <= 1e-4
    assert got_tokens == want_tokens
    layers = SPECS[arch].num_layers
    assert calls["paged_decode_attention"] == 5 * layers  # 5 decode steps; the 2 prefill steps use SDPA
    assert calls["rms_norm_residual"] == 7 * layers
    assert calls["fused_moe"] == (7 * layers if arch == "qwen3_moe" else 0)
    assert calls["rope"] == 2 * 7 * layers  # queries and keys, every step


def test_gemma3_block_takes_the_fused_add_norm() -> None:
    """Gemma 3's sandwich norms: the post-attention residual add and the MLP's pre-norm are one kernel."""
    from tests.fixtures_models import hf_canonical, hf_model, state_dict_np
    from twinfer.backends.cuda.runner import build_torch_runner
    from twinfer.runtime.batch import LogitsWanted, SeqChunk, StepBatch
    from twinfer.runtime.loaders import spec_from_config

    model = hf_model("gemma3")
    spec = spec_from_config(model.config.to_dict())
    weights = hf_canonical(state_dict_np(model), "gemma3", True)
    tokens = [int(t) for t in np.random.default_rng(3).integers(0, 96, 12)]
    batch = StepBatch([SeqChunk(1, tokens, 0, [0, 1, 2], LogitsWanted.ALL)])
    plain = build_torch_runner(spec, weights, kv_tokens=64, block_size=4, kernels="torch", device=DEVICE)
    fused = build_torch_runner(spec, weights, kv_tokens=64, block_size=4, kernels="triton", cuda_graphs=False,
                               device=DEVICE)
    k, calls = fused.torch_ops._k, []
    fn = k.rms_norm_residual
    k.rms_norm_residual = lambda *a, **kw: (calls.append(1), fn(*a, **kw))[1]
    rows = {"torch": plain.step(batch), "triton": fused.step(batch)}
    assert len(calls) == spec.num_layers
    assert np.abs(rows["triton"] - rows["torch"]).max() <= 1e-4


def test_kernel_choice_is_checked() -> None:
    from twinfer.backends.cuda.kernels import select_kernels
    from twinfer.runtime.errors import BackendUnavailable

    assert select_kernels("auto", "cpu") == "torch" and select_kernels("torch", "cuda") == "torch"
    assert select_kernels("triton", "cpu" if DEVICE == "cpu" else "cuda") == "triton"  # cpu: interpreted
    with pytest.raises(BackendUnavailable, match="not one of auto, triton, torch"):
        select_kernels("cutlass", "cuda")
    with pytest.raises(BackendUnavailable, match="run on CUDA devices, not 'mps'"):
        select_kernels("triton", "mps")
