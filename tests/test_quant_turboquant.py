"""TurboQuant: rotation, computed Lloyd-Max codebooks, distortion vs the paper, QJL, KV and weights."""

from __future__ import annotations

import math

import numpy as np
import pytest

from twinfer.quant.hadamard import HadamardRotation, fwht
from twinfer.quant.lloyd_max import lloyd_max
from twinfer.quant.qjl import TurboQuantProd, paper_prod_bound
from twinfer.quant.turboquant import (
    TurboQuant,
    TurboQuantMSE,
    choose_outliers,
    paper_mse_bound,
    split_rate,
)
from twinfer.quant.turboquant_kv import TurboQuantKV
from twinfer.quant.turboquant_weight import default_block, matmul, turboquant_weight

# D_mse of a unit vector as printed in the paper (Theorem 1), b = 1..4, and Max's (1960) exact
# Gaussian Lloyd-Max distortions they round.
PAPER_DMSE = {1: 0.36, 2: 0.117, 3: 0.03, 4: 0.009}
MAX_1960 = {1: 0.3634, 2: 0.1175, 3: 0.03454, 4: 0.009497}
# Inner-product distortion * d for unit x, y (Theorem 2).
PAPER_DPROD = {1: 1.57, 2: 0.56, 3: 0.18, 4: 0.047}


def _unit(n: int, d: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _agrees_with_paper(measured: float, printed: float) -> bool:
    """Within 5% of the printed number, or equal to it at the precision it was printed with."""
    digits = -math.floor(math.log10(printed)) + len(f"{printed:g}".replace("0.", "").lstrip("0")) - 1
    return abs(measured - printed) <= 0.05 * printed or round(measured, digits) == printed


# --- rotation ----------------------------------------------------------------------------------


def test_fwht_is_sylvester_hadamard() -> None:
    h = np.array([[1.0]])
    for _ in range(5):
        h = np.kron(np.array([[1.0, 1.0], [1.0, -1.0]]), h)
    np.testing.assert_allclose(fwht(np.eye(32)), h / math.sqrt(32), atol=1e-6)


def test_fwht_matches_mlx_hadamard_transform() -> None:
    mx = pytest.importorskip("mlx.core")
    x = np.random.default_rng(0).standard_normal((3, 256)).astype(np.float32)
    np.testing.assert_allclose(np.array(mx.hadamard_transform(mx.array(x))), fwht(x), atol=1e-5)


@pytest.mark.parametrize("dim", [128, 100])
def test_rotation_is_orthogonal_and_seeded(dim: int) -> None:
    r = HadamardRotation(dim, seed=3)
    m = r.matrix()  # [D, dim]
    assert m.shape == (r.padded_dim, dim) and r.padded_dim == 128
    np.testing.assert_allclose(m.T @ m, np.eye(dim), atol=1e-5)
    x = np.random.default_rng(0).standard_normal((7, dim)).astype(np.float32)
    np.testing.assert_allclose(r.inverse(r.forward(x)), x, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(r.forward(x), axis=1), np.linalg.norm(x, axis=1), rtol=1e-5)
    assert np.array_equal(HadamardRotation(dim, seed=3).signs, r.signs)
    assert not np.array_equal(HadamardRotation(dim, seed=4).signs, r.signs)


# --- Lloyd-Max codebooks -----------------------------------------------------------------------


def test_gaussian_codebooks_match_known_lloyd_max() -> None:
    one, two = lloyd_max(1), lloyd_max(2)
    np.testing.assert_allclose(one.centroids, [-math.sqrt(2 / math.pi), math.sqrt(2 / math.pi)], atol=1e-5)
    np.testing.assert_allclose(two.centroids, [-1.5104, -0.4528, 0.4528, 1.5104], atol=2e-4)
    np.testing.assert_allclose(two.boundaries, [-0.9816, 0.0, 0.9816], atol=2e-4)
    for bits, value in MAX_1960.items():
        cb = lloyd_max(bits)
        assert cb.distortion == pytest.approx(value, rel=2e-3)
        assert cb.distortion < paper_mse_bound(bits)


def test_beta_codebooks_tend_to_gaussian() -> None:
    for bits in (2, 3, 4):
        d16, d128, d4096 = (lloyd_max(bits, d).distortion for d in (16, 128, 4096))
        gauss = lloyd_max(bits).distortion
        assert d16 < d128 < d4096 < gauss  # a bounded coordinate is easier to quantize
        assert d4096 == pytest.approx(gauss, rel=2e-3)
        assert np.all(np.diff(lloyd_max(bits, 128).centroids) > 0)


# --- TurboQuant-MSE ----------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_mse_distortion_matches_codebook_and_paper(bits: int) -> None:
    x = _unit(3000, 128, seed=bits)
    q = TurboQuantMSE(128, bits, seed=11)
    c = q.quantize(x)
    assert c.codes.shape == (3000, 128 * bits // 8) and c.nbytes == 3000 * (16 * bits + 2)
    measured = float(np.mean(np.sum((q.dequantize(c) - x) ** 2, axis=1)))
    assert measured == pytest.approx(q.codebook.distortion, rel=0.05)
    assert measured < paper_mse_bound(bits)
    assert _agrees_with_paper(measured, PAPER_DMSE[bits])


def test_three_rounds_handle_structured_vectors() -> None:
    onehot = np.eye(128, dtype=np.float32)
    rng = np.random.default_rng(5)
    sparse = np.zeros((1000, 128), np.float32)
    np.put_along_axis(
        sparse, rng.integers(0, 128, (1000, 3)), rng.standard_normal((1000, 3)).astype(np.float32), 1
    )
    sparse /= np.linalg.norm(sparse, axis=1, keepdims=True)

    def dmse(x: np.ndarray, rounds: int, seed: int) -> float:
        q = TurboQuantMSE(128, 2, seed=seed, rounds=rounds)
        return float(np.mean(np.sum((q.dequantize(q.quantize(x)) - x) ** 2, axis=1)))

    target = lloyd_max(2, 128).distortion
    assert dmse(onehot, rounds=1, seed=0) > 1.5 * target  # every coordinate lands on +-1/sqrt(D)
    assert max(dmse(onehot, rounds=2, seed=s) for s in range(6)) > 1.15 * target  # one shared draw
    for seed in range(6):  # the default, three rounds
        assert dmse(onehot, 3, seed) < 1.1 * target and dmse(sparse, 3, seed) < 1.1 * target


def test_norms_scale_and_zero_vectors() -> None:
    q = TurboQuantMSE(64, 3, seed=0)
    x = _unit(1, 64, seed=1) * np.array([[0.0], [1e-3], [1.0], [300.0]], np.float32)
    c = q.quantize(x)
    assert c.norms.dtype == np.float16
    y = q.dequantize(c)
    assert not y[0].any()
    np.testing.assert_allclose(y[3] / 300.0, y[2], rtol=2e-3, atol=1e-4)
    with pytest.raises(ValueError, match="float16"):
        q.quantize(x * 1e3)


# --- fractional rates --------------------------------------------------------------------------


def test_split_rate_and_outlier_choice() -> None:
    assert (
        split_rate(2.5, 128) == (2, 64) and split_rate(3.5, 256) == (3, 128) and split_rate(4, 128) == (4, 0)
    )
    rng = np.random.default_rng(0)
    calib = rng.standard_normal((200, 2, 16)).astype(np.float32)
    calib[:, 0, [3, 9]] *= 20
    calib[:, 1, [0, 15]] *= 20
    assert choose_outliers(calib, 2).tolist() == [[3, 9], [0, 15]]
    with pytest.raises(ValueError, match="choose_outliers"):
        TurboQuant(128, 2.5)


def test_fractional_rates_sit_between_integer_rates() -> None:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1500, 1, 128)).astype(np.float32)
    x[:, :, :16] *= 8.0  # outlier channels, as in real key caches
    err = {}
    for rate in (2, 2.5, 3, 3.5, 4):
        _, n_hi = split_rate(rate, 128)
        tq = TurboQuant(128, rate, seed=1, outliers=choose_outliers(x[:500], n_hi) if n_hi else None)
        t = tq.quantize(x[500:])
        assert t.nbytes * 8 / x[500:].size == pytest.approx(tq.bits_per_element())
        err[rate] = float(np.sum((tq.dequantize(t) - x[500:]) ** 2) / np.sum(x[500:] ** 2))
    assert err[2] > err[2.5] > err[3] > err[3.5] > err[4]


# --- TurboQuant-prod (QJL) ---------------------------------------------------------------------


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_prod_is_unbiased_with_bounded_variance(bits: int) -> None:
    d, trials = 64, 400
    x = _unit(1, d, seed=20)[0]
    y = 0.6 * x + 0.8 * _unit(1, d, seed=21)[0]
    y /= np.linalg.norm(y)
    true = float(x @ y)
    est = np.array(
        [
            (lambda q: q.inner_products(y[None], q.quantize(x[None]))[0, 0])(TurboQuantProd(d, bits, seed=s))
            for s in range(trials)
        ]
    )
    se = est.std() / math.sqrt(trials)
    assert abs(est.mean() - true) < 4 * se
    var = float(np.mean((est - true) ** 2))
    assert var < paper_prod_bound(bits, d)
    assert var * d == pytest.approx(PAPER_DPROD[bits], rel=0.3)


def test_mse_quantizer_is_biased_for_inner_products() -> None:
    d = 256
    x = _unit(1, d, seed=30)[0]
    y = x.copy()
    est = [
        float(y @ (lambda q: q.dequantize(q.quantize(x[None]))[0])(TurboQuantMSE(d, 1, seed=s)))
        for s in range(100)
    ]
    assert np.mean(est) == pytest.approx(2 / math.pi, rel=0.03)  # the 1-bit shrinkage the paper cites


# --- KV cache ----------------------------------------------------------------------------------


@pytest.mark.parametrize("rate", [2, 2.5, 3, 3.5, 4])
def test_kv_block_per_head(rate: float) -> None:
    rng = np.random.default_rng(4)
    kv = rng.standard_normal((96, 4, 64)).astype(np.float32)
    kv[:, :, 7] *= 12.0
    q = TurboQuantKV.calibrate(kv[:32], rate, seed=9)
    t = q.quantize(kv[32:])
    deq = q.dequantize(t)
    assert deq.shape == (64, 4, 64)
    assert t.nbytes * 8 / deq.size == pytest.approx(q.bits_per_element())
    rel = np.sum((deq - kv[32:]) ** 2) / np.sum(kv[32:] ** 2)
    assert rel < 1.3 * lloyd_max(math.floor(rate), 64).distortion
    queries = rng.standard_normal((3, 4, 64)).astype(np.float32)
    np.testing.assert_allclose(
        q.scores(queries, t), np.einsum("ahd,bhd->hab", queries, deq), rtol=1e-4, atol=1e-3
    )


def test_kv_inner_product_variant() -> None:
    rng = np.random.default_rng(6)
    keys = rng.standard_normal((40, 2, 64)).astype(np.float32)
    q = TurboQuantKV(64, 2, 3, seed=1, inner_product=True)
    t = q.quantize(keys)
    assert q.bits_per_element() == pytest.approx((64 * 2 + 16 + 64 + 16) / 64)
    assert t.nbytes * 8 / keys.size == pytest.approx(q.bits_per_element())
    queries = rng.standard_normal((5, 2, 64)).astype(np.float32)
    s = q.scores(queries, t)
    assert s.shape == (2, 5, 40)
    np.testing.assert_allclose(s, np.einsum("ahd,bhd->hab", queries, q.dequantize(t)), rtol=1e-4, atol=1e-3)
    with pytest.raises(ValueError, match="integer rate"):
        TurboQuantKV(64, 2, 2.5, inner_product=True)


# --- weights -----------------------------------------------------------------------------------


def test_default_block() -> None:
    assert [default_block(n) for n in (640, 2048, 96, 100, 4)] == [128, 128, 32, 100, 4]


@pytest.mark.parametrize("rate", [2, 2.5, 3, 3.5, 4])
def test_weight_matmul_rotates_activations(rate: float) -> None:
    rng = np.random.default_rng(7)
    w = rng.standard_normal((96, 640)).astype(np.float32)
    x = rng.standard_normal((2, 3, 640)).astype(np.float32)
    qw = turboquant_weight(w, rate, seed=5, calibration=x.reshape(-1, 640) if rate % 1 else None)
    assert qw.block == 128
    deq = qw.unpack()
    y = matmul(x, qw)
    assert y.shape == (2, 3, 96)
    np.testing.assert_allclose(y, x @ deq.T, rtol=1e-4, atol=2e-3)
    rel = np.sum((deq - w) ** 2) / np.sum(w**2)
    assert rel < 1.1 * lloyd_max(math.floor(rate), 128).distortion
    assert qw.nbytes * 8 / w.size == pytest.approx(qw.quantizer.bits_per_element())
