"""`twinfer quantize`: uniform and searched assignments on a tiny model, the folder's recorded KL,
`--verify` catching a damaged folder, the layer-selection search on a hand-made probe, CLI errors."""

from __future__ import annotations

import json
import string
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_quant_backends import tiny_gemma  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from twinfer.cli.main import app  # noqa: E402
from twinfer.cli.quantize_cmd import QuantizeOptions, quantize, verify_folder  # noqa: E402
from twinfer.quant.registry import FORMATS  # noqa: E402
from twinfer.quant.search import FormatSearch, KLStats  # noqa: E402
from twinfer.runtime.loaders import load_model  # noqa: E402


def _char_tokenizer(folder: Path) -> None:
    """A character-level tokenizer.json over the tiny model's 96 ids (printable ASCII + <unk>)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    chars = [c for c in string.printable if c not in "\x0b\x0c\r"][:95]
    vocab = {"<unk>": 0, **{c: i + 1 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.save(str(folder / "tokenizer.json"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tiny_gemma(tmp_path_factory.mktemp("qcmd") / "tiny")
    _char_tokenizer(path)
    return path


def test_uniform_quantize_writes_a_measured_folder(tiny: Path, tmp_path: Path) -> None:
    out = tmp_path / "q"
    s = quantize(str(tiny), out, QuantizeOptions(3.2, ("tq2", "tq3", "tq4"), False, 64, "prose", "block"))
    assert s["formats"] == {"tq3": 21} and s["bits_per_weight"] == pytest.approx(FORMATS["tq3"])
    config = json.loads((out / "config.json").read_text())
    qc = config["quantization_config"]
    assert qc["quant_method"] == "twinfer" and qc["kl"]["mean_kl"] == s["kl"]["mean_kl"] > 0
    assert load_model(out).weights.dtype_stored("layers.2.down") == "tq3"
    report = verify_folder(out)
    assert not report["regressed"] and report["measured_kl"] == pytest.approx(report["recorded_kl"], rel=1e-4)


def test_verify_warns_when_the_folder_regressed(tiny: Path, tmp_path: Path) -> None:
    out = tmp_path / "q"
    quantize(str(tiny), out, QuantizeOptions(4.2, ("tq4",), False, 32, "prose", "block"))
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["verify"]["mean_kl"] /= 100  # as if the folder had been far better
    (out / "config.json").write_text(json.dumps(config))
    with pytest.warns(UserWarning, match="KL regressed"):
        assert verify_folder(out)["regressed"]


def test_searched_quantize_fits_the_budget(tiny: Path, tmp_path: Path) -> None:
    s = quantize(str(tiny), tmp_path / "q", QuantizeOptions(3.0, ("tq2", "tq3", "tq4"), True, 48, "prose", "block"))
    assert s["bits_per_weight"] <= 3.0 + 1e-9
    assert len(s["formats"]) >= 2  # a budget between formats mixes them
    assert s["history"] and s["history"][-1][2] <= s["history"][0][2]  # measured moves never make it worse


class FakeProbe:
    """A probe with two groups whose errors cancel: quantizing both is better than either alone."""

    def __init__(self) -> None:
        self.weights = _FakeWeights()
        self.evaluations = 0

    def measure(self, assignment: dict[str, str]) -> KLStats:
        self.evaluations += 1
        a, b = assignment.get("layers.0.q", "int8"), assignment.get("layers.1.q", "int8")
        err = {"int8": 0.0, "tq4": 0.01, "tq2": 0.1}
        kl = abs(err[a] - err[b]) + 0.001 * (a != "int8") + 0.001 * (b != "int8")
        return KLStats(kl, kl, 1.0)


class _FakeWeights:
    def names(self) -> list[str]:
        return ["layers.0.q", "layers.1.q"]

    def shape(self, name: str) -> tuple[int, int]:
        return (128, 128)


def test_search_measures_interactions_the_additive_model_misses() -> None:
    probe = FakeProbe()
    search = FormatSearch(probe, ["int8", "tq4", "tq2"], "tensor")  # type: ignore[arg-type]
    search.measure_sensitivities()
    budget = (FORMATS["tq2"] + FORMATS["tq2"]) / 2  # only both-at-tq2 fits
    result = search.search(budget)
    assert set(result.assignment.values()) == {"tq2"}
    assert result.kl.mean == pytest.approx(0.002)  # far below either group's own sensitivity (0.101)
    assert result.predicted_kl > 10 * result.kl.mean


def test_cli_errors_are_one_line(tiny: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    r = runner.invoke(app, ["quantize", str(tiny), "--out", str(tmp_path / "x"), "--budget", "1.0", "--formats", "tq3"])
    assert r.exit_code != 0 and "below every format" in str(r.exception)
    r = runner.invoke(app, ["quantize", str(tiny), "--out", str(tmp_path / "x"), "--budget", "4", "--formats", "int3"])
    assert r.exit_code != 0 and "unknown weight format 'int3'" in str(r.exception)
    r = runner.invoke(app, ["quantize", str(tiny), "--verify"])
    assert r.exit_code != 0 and "not a twinfer quantized folder" in str(r.exception)
