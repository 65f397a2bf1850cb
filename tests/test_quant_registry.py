"""The format registry the planner reads: names, storage cost, native hardware, dispatch."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from twinfer.quant import FORMAT_INFO, FORMATS, native_on, pack_weight
from twinfer.quant.turboquant import TurboQuant


def test_format_names_and_bits() -> None:
    assert list(FORMATS) == [
        "int8",
        "int4",
        "fp8",
        "fp8-block",
        "nvfp4",
        "mxfp4",
        "tq2",
        "tq2.5",
        "tq3",
        "tq3.5",
        "tq4",
    ]
    assert FORMATS["int4"] == 4.5 and FORMATS["int8"] == 8.5  # float16 scale + bias per 64 weights
    assert FORMATS["nvfp4"] == 4.5 and FORMATS["mxfp4"] == 4.25 and FORMATS["fp8"] == 8.0
    assert FORMATS["fp8-block"] == pytest.approx(8.002, abs=1e-3)
    assert [FORMATS[f"tq{r}"] for r in ("2", "2.5", "3", "3.5", "4")] == [2.125, 2.75, 3.125, 3.75, 4.125]


@pytest.mark.parametrize("rate", [2, 3, 4])
def test_tq_bits_match_the_quantizer(rate: int) -> None:
    assert FORMATS[f"tq{rate}"] == TurboQuant(128, rate).bits_per_element()


def test_native_on() -> None:
    assert set(native_on("blackwell")) == {"fp8", "fp8-block", "nvfp4", "mxfp4"}
    assert set(native_on("hopper")) == set(native_on("ada")) == {"fp8", "fp8-block"}
    assert native_on("apple") == () and native_on("cpu") == () and native_on("ampere") == ()
    assert "dequant" in FORMAT_INFO["tq3"].note and "dequant" in FORMAT_INFO["int4"].note
    with pytest.raises(ValueError, match="unknown hardware family"):
        native_on("h100")


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_pack_weight_dispatch(fmt: str) -> None:
    w = np.random.default_rng(0).standard_normal((32, 256)).astype(np.float32)
    p = pack_weight(fmt, w)
    rel = np.linalg.norm(p.unpack() - w) / np.linalg.norm(w)
    assert rel < {"int8": 0.01, "fp8": 0.04, "fp8-block": 0.04}.get(fmt, 0.4)
    stored = p.nbytes * 8 / w.size
    # Reference arrays keep float32 affine scales; everything else stores what the registry counts.
    expected = FORMATS[fmt] + (0.5 if fmt.startswith("int") else 0.0)
    assert stored == pytest.approx(expected, abs=0.01)


def test_unknown_format_is_explained() -> None:
    with pytest.raises(ValueError, match="choose one of"):
        pack_weight("q4_k", np.zeros((4, 32), np.float32))


def test_quant_imports_neither_torch_nor_mlx() -> None:
    code = (
        "import sys, twinfer.quant, twinfer.quant.affine, twinfer.formats.fp8, twinfer.formats.nvfp4, "
        "twinfer.formats.mxfp4, twinfer.quant.qjl; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'mlx', 'safetensors')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
