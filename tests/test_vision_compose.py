"""A composed model: the tiny Gemma 3 checkpoint's frozen SigLIP tower + projector in front of another
Gemma 3 text model of the same width, named by a composition file. Text never reaches the encoder, so
`twinfer eval kl` of the composition against the language model alone is exactly 0; images get the
vision checkpoint's own features; a width mismatch is refused before any weight is read."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from twinfer.runtime.errors import ModelError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _save_text_model(folder: Path, hidden: int, seed: int) -> Path:
    """A random Gemma 3 text model (`Gemma3ForCausalLM`) over the tiny vision checkpoint's vocabulary."""
    from vision_models import TEXT_CONFIG, tiny_tokenizer

    from twinfer.runtime.models.gemma3 import CHAT_TEMPLATE

    torch.manual_seed(seed)
    config = transformers.Gemma3TextConfig(**dict(TEXT_CONFIG, hidden_size=hidden))
    model = transformers.Gemma3ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.5)
    model.save_pretrained(folder)
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from vision_models import save_tiny_gemma3_vision

    root = tmp_path_factory.mktemp("compose")
    vlm = save_tiny_gemma3_vision(root / "vlm")
    lm = _save_text_model(root / "lm", 64, seed=7)
    (root / "compose.json").write_text(json.dumps({"vision": "vlm", "language": "lm"}))
    wide = _save_text_model(root / "wide", 96, seed=8)
    (root / "mismatch.toml").write_text(f'vision = "{vlm}"\nlanguage = "{wide}"\n')
    return {"vlm": vlm, "lm": lm, "compose": root / "compose.json", "mismatch": root / "mismatch.toml"}


def test_eval_kl_of_the_composition_against_its_language_model_is_exactly_zero(
        models: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    from twinfer.cli.eval_cmd import EvalKLOptions, run_eval_kl

    run_eval_kl(EvalKLOptions(model=str(models["lm"]), reference="torch", candidate=str(models["compose"]),
                              corpus="prose", tokens=160, window=64, json_out=True))
    report = json.loads(capsys.readouterr().out)
    assert report["tokens"] > 100
    assert report["mean_kl"] == 0.0 and report["max_kl"] == 0.0 and report["top1_agreement"] == 1.0


@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_the_composition_runs_the_language_model_and_reads_images_with_the_vision_checkpoint(
        models: dict[str, Path], backend: str) -> None:
    from vision_models import gemma3_pixel_values, random_pixels, tiny_gemma3_vision

    from twinfer.app.models import open_model
    from twinfer.quant.fidelity import RunnerSource
    from twinfer.runtime.vision import Image

    if backend == "mlx":
        pytest.importorskip("mlx.core")
    composed = open_model(str(models["compose"]), backend, max_seqs=2, ctx=64)
    alone = open_model(str(models["lm"]), backend, max_seqs=2, ctx=64)
    assert alone.runner.vision is None and composed.runner.vision is not None
    assert composed.path == models["lm"].resolve()
    tokens = [2, *range(20, 60)]
    assert np.array_equal(RunnerSource(composed.runner).logits(tokens), RunnerSource(alone.runner).logits(tokens))
    pixels = random_pixels(3)
    features = np.asarray(composed.runner.vision.encode(Image(pixels)), dtype=np.float32)
    with torch.no_grad():
        reference = tiny_gemma3_vision().model.get_image_features(gemma3_pixel_values(pixels)).pooler_output
    np.testing.assert_allclose(features, reference.reshape(features.shape).numpy(), atol=1e-5)


def test_a_width_mismatch_is_refused_with_both_widths(models: dict[str, Path]) -> None:
    from twinfer.app.session import OpenOptions, open_session

    with pytest.raises(ModelError, match="projects images to 64-wide features, but the language model wide is "
                                         "96 wide; compose a language model of width 64"):
        open_session(OpenOptions(str(models["mismatch"]), backend="torch"))


@pytest.mark.parametrize(("content", "message"), [
    ('{"vision": "vlm"}', "missing: language"),
    ('{"vision": "vlm", "language": "lm", "draft": "x"}', "unknown keys: draft"),
    ('{"vision": "nowhere", "language": "lm"}', "vision 'nowhere' is not a model folder"),
])
def test_a_bad_composition_file_says_what_to_write(models: dict[str, Path], content: str, message: str) -> None:
    from twinfer.runtime.vision.compose import read_composition

    path = models["compose"].parent / "bad.json"
    path.write_text(content)
    with pytest.raises(ModelError, match=message):
        read_composition(path)
    assert read_composition(models["lm"] / "config.json") is None  # a checkpoint's own config is a model file


def test_twinfer_plan_of_a_composition_counts_the_borrowed_encoder(models: dict[str, Path]) -> None:
    from vision_models import MM_TOKENS, tiny_gemma3_vision

    from twinfer.planners.source import resolve

    model = tiny_gemma3_vision().model
    expected = sum(p.numel() for m in (model.vision_tower, model.multi_modal_projector) for p in m.parameters())
    profile = resolve(str(models["compose"]))
    alone = resolve(str(models["lm"]))
    assert alone.vision is None and profile.vision is not None
    assert (profile.vision.params, profile.vision.tokens_per_image) == (expected, MM_TOKENS)
    assert profile.params == alone.params  # the language model's weights, counted once
    with pytest.raises(ModelError, match="compose a language model of width 64"):
        resolve(str(models["mismatch"]))
