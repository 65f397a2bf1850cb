"""Quantization inside the backends: quantized linears (torch, MLX) against the numpy references,
the TurboQuant KV cache on both backends, the quantized model folder, and `eval kl` SPEC options."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
mx = pytest.importorskip("mlx.core")
transformers = pytest.importorskip("transformers")

from twinfer.backends.cuda.quant import torch_weight  # noqa: E402
from twinfer.backends.cuda.runner import build_torch_runner  # noqa: E402
from twinfer.backends.metal.quant import mlx_weight  # noqa: E402
from twinfer.backends.metal.runner import build_mlx_runner, load_mlx_runner  # noqa: E402
from twinfer.quant import affine  # noqa: E402
from twinfer.quant.fidelity import parse_spec  # noqa: E402
from twinfer.quant.kl import KLAccumulator, kl_rows  # noqa: E402
from twinfer.quant.kv_format import mse_sets, parse_kv_format  # noqa: E402
from twinfer.quant.linear import QuantizedWeight, tq_linear_parts  # noqa: E402
from twinfer.quant.model_io import QuantizedView, quantizable, write_quantized  # noqa: E402
from twinfer.quant.registry import FORMATS  # noqa: E402
from twinfer.quant.turboquant_weight import matmul as tq_matmul  # noqa: E402
from twinfer.runtime.batch import LogitsWanted, SeqChunk, StepBatch  # noqa: E402
from twinfer.runtime.errors import TwinferError  # noqa: E402
from twinfer.runtime.loaders import load_model  # noqa: E402
from twinfer.runtime.runner import OpsRunner  # noqa: E402

VOCAB = 96
TOKENS = [int(t) for t in np.random.default_rng(0).integers(0, VOCAB, 40)]


def tiny_gemma(path: Path) -> Path:
    """A random Gemma 3 with widths every format accepts (in-features 128 and 256), saved as HF."""
    torch.manual_seed(0)
    cfg = transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=256, head_dim=32, sliding_window=16, query_pre_attn_scalar=32,
    )
    model = transformers.Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
            elif "embed" in name:  # small enough that the next-token distribution is not one-hot
                p.normal_(0.0, 0.08)
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    model.save_pretrained(path)
    return path


@cache
def _tiny() -> tuple[object, dict[str, np.ndarray]]:
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="twinfer-quant-"))
    loaded = load_model(tiny_gemma(root / "tiny"))
    return loaded, {n: loaded.weights.load(n) for n in loaded.weights.names()}


def _logits(runner: OpsRunner, split: bool = False) -> np.ndarray:
    table = list(range(8))
    if not split:
        return runner.step(StepBatch([SeqChunk(1, TOKENS, 0, table, LogitsWanted.ALL)]))
    rows = [runner.step(StepBatch([SeqChunk(1, TOKENS[:30], 0, table, LogitsWanted.ALL)]))]
    for i in range(30, len(TOKENS)):  # decode one token at a time against the coded cache
        rows.append(runner.step(StepBatch([SeqChunk(1, TOKENS[i : i + 1], i, table, LogitsWanted.ALL)])))
    return np.concatenate(rows)


def _run(backend: str, weights: object, kv: str | None = None, split: bool = False) -> np.ndarray:
    loaded, _ = _tiny()
    build = build_torch_runner if backend == "torch" else build_mlx_runner
    return _logits(build(loaded.spec, weights, kv_tokens=64, block_size=8, kv_format=kv), split)  # type: ignore[attr-defined, operator]


# -- quantized linears -------------------------------------------------------------------------------
ALL_FORMATS = list(FORMATS)


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_quantized_weight_tensors_round_trip(fmt: str) -> None:
    w = np.random.default_rng(1).standard_normal((48, 256)).astype(np.float32) * 0.1
    qw = QuantizedWeight.quantize(fmt, w)
    arrays, meta = qw.to_tensors()
    back = QuantizedWeight.from_tensors(json.loads(json.dumps(meta)), {k: v.copy() for k, v in arrays.items()})
    np.testing.assert_array_equal(back.dequantize(), qw.dequantize())
    rel = np.linalg.norm(qw.dequantize() - w) / np.linalg.norm(w)
    assert rel < {"int8": 0.01, "fp8": 0.05, "fp8-block": 0.05}.get(fmt, 0.35), rel


@pytest.mark.parametrize("fmt", ["int4", "int8", "tq2.5", "tq3", "tq4", "nvfp4"])
def test_backend_linears_match_numpy_reference(fmt: str) -> None:
    rng = np.random.default_rng(2)
    w = rng.standard_normal((40, 256)).astype(np.float32) * 0.05
    x = rng.standard_normal((5, 256)).astype(np.float32)
    qw = QuantizedWeight.quantize(fmt, w)
    if fmt.startswith("tq"):
        ref = tq_matmul(x, qw.packed)  # rotate activations, codebook-decoded rotated weight
    elif fmt.startswith("int"):
        ref = affine.matmul(x, qw.packed)
    else:
        ref = x @ qw.dequantize().T
    t = torch_weight(qw, torch.device("cpu"), torch.float32)
    got_t = (t(torch.from_numpy(x), None) if callable(t) else torch.from_numpy(x) @ t.T).numpy()
    m = mlx_weight(qw, mx.float32)
    got_m = np.array(m(mx.array(x), None) if callable(m) else mx.array(x) @ m.T)
    np.testing.assert_allclose(got_t, ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got_m, ref, rtol=1e-4, atol=1e-4)


def test_mlx_affine_is_quantized_matmul_in_mlx_layout() -> None:
    w = np.random.default_rng(3).standard_normal((64, 128)).astype(np.float32)
    qw = QuantizedWeight.quantize("int4", w)
    wq, scales, biases = mx.quantize(mx.array(w), group_size=64, bits=4)
    np.testing.assert_array_equal(np.array(wq), qw.packed.wq)  # bit-identical to MLX's own packing
    layer = mlx_weight(qw, mx.float32)
    assert layer.wq.dtype == mx.uint32 and layer.bits == 4 and layer.group == 64


def test_rotations_are_orthogonal() -> None:
    qw = QuantizedWeight.quantize("tq2.5", np.random.default_rng(4).standard_normal((8, 256)).astype(np.float32))
    for rot in tq_linear_parts(qw.packed).rotation:  # [D, d]: orthonormal columns
        np.testing.assert_allclose(rot.T @ rot, np.eye(rot.shape[1]), atol=1e-5)
    for s in mse_sets(3.5, 256, seed=7):
        np.testing.assert_allclose(s.rotation.T @ s.rotation, np.eye(s.dim), atol=1e-5)


# -- the TurboQuant KV cache ---------------------------------------------------------------------------
def test_kv_format_parsing_and_bits() -> None:
    assert parse_kv_format("f32") is None and parse_kv_format(None) is None
    f = parse_kv_format("tq2.5")
    assert f is not None and f.rate == 2.5 and not f.qjl
    assert f.bits_per_element(256) == pytest.approx(2.5 + 32 / 256)  # two fp16 norms per head vector
    q = parse_kv_format("tq4-qjl")
    assert q is not None and q.qjl and q.name == "tq4-qjl"
    with pytest.raises(ValueError, match="integer rate"):
        parse_kv_format("tq2.5-qjl")
    with pytest.raises(ValueError, match="unknown KV format"):
        parse_kv_format("q4_0")
    c = parse_kv_format("tq3.5c")
    assert c is not None and c.centered and c.rate == 3.5 and c.name == "tq3.5c"


@pytest.mark.parametrize("kv", ["tq2.5", "tq4", "tq3-qjl", "tq4c"])
def test_tq_kv_cache_torch_and_mlx_agree_and_decode_continues(kv: str) -> None:
    _, weights = _tiny()
    dense = _run("torch", weights)
    t_once, t_split = _run("torch", weights, kv), _run("torch", weights, kv, split=True)
    m_once = _run("mlx", weights, kv)
    np.testing.assert_allclose(t_once, m_once, atol=2e-3, rtol=1e-3)
    np.testing.assert_allclose(t_split, _run("mlx", weights, kv, split=True), atol=2e-3, rtol=1e-3)
    fmt = parse_kv_format(kv)
    assert fmt is not None
    if fmt.rate == int(fmt.rate) and not fmt.centered:  # (else the first write fixes outliers / means)
        # decoding token by token against the coded cache gives the rows a one-shot prefill gives
        np.testing.assert_allclose(t_split, t_once, atol=2e-3, rtol=1e-3)
    assert 0 < kl_rows(dense, t_once).mean() < 0.2


def test_tq_kv_error_falls_with_rate() -> None:
    _, weights = _tiny()
    dense = _run("torch", weights)
    kls = [kl_rows(dense, _run("torch", weights, f"tq{r:g}")).mean() for r in (2, 3, 4)]
    assert kls[0] > kls[1] > kls[2] > 0, kls


# -- a quantized model folder ---------------------------------------------------------------------------
MIXED = {"q": "int4", "k": "tq2.5", "v": "tq4", "o": "nvfp4", "gate": "tq3", "up": "int8", "down": "mxfp4"}


def test_quantized_folder_loads_on_torch_and_mlx(tmp_path: Path) -> None:
    loaded, weights = _tiny()
    names = quantizable(loaded.weights)  # type: ignore[attr-defined]
    assert len(names) == 3 * 7
    assignment = {n: MIXED[n.rsplit(".", 1)[1]] for n in names}
    view = QuantizedView(loaded.weights, assignment)  # type: ignore[attr-defined]
    write_quantized(tmp_path / "q", loaded.spec, view, loaded.path)  # type: ignore[attr-defined]
    folder = load_model(tmp_path / "q")
    assert folder.format == "quantized"
    assert folder.weights.dtype_stored("layers.1.k") == "tq2.5"
    assert isinstance(folder.weights.load("layers.0.q"), QuantizedWeight)

    from twinfer.backends.cuda.runner import load_torch_runner

    t = _logits(load_torch_runner(folder, kv_tokens=64, block_size=8))
    m = _logits(load_mlx_runner(folder, kv_tokens=64, block_size=8))
    np.testing.assert_allclose(t, m, atol=2e-3, rtol=1e-3)
    dequant = {n: (view.load(n).dequantize() if n in assignment else w) for n, w in weights.items()}
    np.testing.assert_allclose(t, _run("torch", dequant), atol=2e-3, rtol=1e-3)
    assert 0 < kl_rows(_run("torch", weights), t).mean() < 0.5


def test_quantized_folder_errors_are_one_line(tmp_path: Path) -> None:
    loaded, _ = _tiny()
    view = QuantizedView(loaded.weights, {"layers.0.q": "tq3"})  # type: ignore[attr-defined]
    write_quantized(tmp_path / "q", loaded.spec, view, loaded.path)  # type: ignore[attr-defined]
    (tmp_path / "q" / "model.safetensors").unlink()
    with pytest.raises(TwinferError, match="no model.safetensors"):
        load_model(tmp_path / "q")
    with pytest.raises(ValueError, match="unknown weight format 'nvfp4x'"):
        QuantizedView(loaded.weights, {"layers.0.q": "int4", "layers.0.down": "nvfp4x"})  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="cannot store a weight of shape"):
        QuantizedWeight.quantize("int4", np.zeros((8, 96), np.float32))  # 96 input channels: not groups of 64


# -- eval kl SPEC options and report ---------------------------------------------------------------------
def test_spec_options_parse_and_reject() -> None:
    assert parse_spec("torch:kv=tq4,weights=int4") == ("torch", {"kv": "tq4", "weights": "int4"})
    assert parse_spec("llamacpp:kv=q4_0") == ("llamacpp", {"kv": "q4_0"})
    with pytest.raises(TwinferError, match="weights=... is not|not one of"):
        parse_spec("llamacpp:weights=int4")
    with pytest.raises(TwinferError, match="unknown SPEC"):
        parse_spec("cuda:kv=tq4")


def test_report_has_same_top_p_and_delta_p() -> None:
    acc = KLAccumulator()
    ref = np.array([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    cand = np.array([[2.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    acc.add(ref, cand, np.array([0, 1]))
    r = acc.report("a", "b", "c")
    assert r.same_top_p == 0.5
    p = np.exp(ref[1, 1]) / np.exp(ref[1]).sum()
    assert r.rms_delta_p == pytest.approx(np.sqrt(((np.exp(0) / np.exp(cand[1]).sum() - p) ** 2) / 2))
    assert any("same top p 50.000 %" in line for line in r.lines())
