"""The planner counts a vision encoder: its weights (catalog entries against transformers' own module
counts, a checkpoint's vision tensors, an mmproj file beside a GGUF) and the KV of each request's
image tokens; `twinfer plan` reports both. Hardware is pinned (a table device or a description)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from twinfer.planners.catalog import find
from twinfer.planners.describe import resolve_cluster
from twinfer.planners.model import ModelProfile
from twinfer.planners.plan import Plan, make_plan, runner_formats
from twinfer.planners.search import Request
from twinfer.planners.source import resolve
from twinfer.runtime.errors import PlanError

H100 = "h100"
CPU = "cpu:memory=64GB,bandwidth=100GB/s,vector=1TFLOPS,cores=8"
# Encoder + projector parameters of each checkpoint, as transformers builds them from the published configs
PUBLISHED = {
    "gemma-3-4b": (419_816_304, 256),
    "gemma-3-12b": (421_290_864, 256),
    "gemma-3-27b": (423_060_336, 256),
    "qwen3.5-35b-a3b": (446_571_248, 784),
    "qwen3.5-397b-a17b": (456_010_480, 784),
    "kimi-k2.5": (471_143_920, 1024),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_catalog_vision_encoders_are_counted_as_published(name: str) -> None:
    vision = find(name).profile().vision
    assert vision is not None
    assert (vision.params, vision.tokens_per_image) == PUBLISHED[name]


def _transformers_count(name: str) -> int:
    """Parameters of transformers' vision tower + projector built (on the meta device) from the config."""
    import torch
    import transformers
    from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector
    from transformers.models.kimi_k25.modeling_kimi_k25 import (
        Kimi_K25MultimodalProjection,
        Kimi_K25VisionModel,
    )
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeVisionModel
    from transformers.models.siglip.modeling_siglip import SiglipVisionModel

    width = find(name).spec.hidden_size
    c: Any
    siglip = dict(hidden_size=1152, intermediate_size=4304, num_attention_heads=16, num_hidden_layers=27)
    with torch.device("meta"):
        if name.startswith("gemma"):
            c = transformers.Gemma3Config(text_config=dict(hidden_size=width), mm_tokens_per_image=256,
                                          vision_config=dict(siglip, image_size=896, patch_size=14,
                                                            vision_use_head=False))
            modules = [SiglipVisionModel(c.vision_config), Gemma3MultiModalProjector(c)]  # type: ignore[arg-type]
        elif name.startswith("qwen"):
            c = transformers.Qwen3_5MoeConfig(vision_config=dict(out_hidden_size=width))
            modules = [Qwen3_5MoeVisionModel._from_config(c.vision_config)]
        else:
            c = transformers.Kimi_K25Config(text_config=dict(hidden_size=width), projection_hidden_size=1152,
                                            vision_config=dict(siglip, patch_size=14, merge_kernel_size=[2, 2]))
            modules = [Kimi_K25VisionModel._from_config(c.vision_config), Kimi_K25MultimodalProjection(c)]
    return sum(p.numel() for m in modules for p in m.parameters())


@pytest.mark.parametrize("name", ["gemma-3-4b", "qwen3.5-35b-a3b", "kimi-k2.5"])
def test_catalog_counts_equal_what_transformers_builds(name: str) -> None:
    assert PUBLISHED[name][0] == _transformers_count(name)


def _plan(profile: ModelProfile, hardware: str, context: int, concurrency: int, images: int | None,
          formats: tuple[str, str] = ("auto", "auto")) -> Plan:
    plan = make_plan(profile.with_images(images), resolve_cluster(hardware), Request(context, concurrency, *formats))
    assert plan.chosen is not None
    return plan


def test_a_plan_counts_the_encoder_and_each_image_tokens_kv() -> None:
    gemma = find("gemma-3-4b").profile()
    plan = _plan(gemma, H100, 4096, 3, images=2)
    mem = plan.chosen.memory  # type: ignore[union-attr]
    # 34 layers x (K + V) x 4 KV heads x 256 x 2 bytes (BF16)
    assert mem.kv_bytes_per_token == 34 * 2 * 4 * 256 * 2 == 139_264
    assert mem.vision_weights == 419_816_304 * 2  # the encoder stays 16-bit in an FP8 plan
    assert mem.image_kv == 3 * 2 * 256 * 139_264 == 213_909_504
    text = _plan(gemma, H100, 4096, 3, images=0).chosen.memory  # type: ignore[union-attr]
    assert (text.vision_weights, text.image_kv) == (mem.vision_weights, 0.0)  # loaded whether used or not
    assert mem.used - text.used == mem.image_kv
    assert plan.to_json()["memory"]["image_kv_bytes_per_device"] == 213_909_504
    assert plan.to_json()["model"]["vision"]["images_per_request"] == 2


def test_llamacpp_cells_round_the_image_tokens_kv() -> None:
    plan = _plan(find("gemma-3-4b").profile(), CPU, 4000, 1, images=1)
    mem = plan.chosen.memory  # type: ignore[union-attr]
    assert plan.strategy is not None and plan.strategy.engine == "llamacpp"
    # 4000 text tokens take 4096 cells, 4256 with the image take 4352: the image costs 256 cells of F16 KV
    assert mem.image_kv == 256 * 139_264
    assert mem.vision_weights == 419_816_304 * 2  # llama.cpp's F16 projector


def test_images_default_to_one_on_a_vision_model_and_are_refused_without_one() -> None:
    assert find("gemma-3-27b").profile().image_tokens == 256
    assert find("llama-3.1-8b").profile().image_tokens == 0
    assert find("llama-3.1-8b").profile().with_images(0).vision is None
    with pytest.raises(PlanError, match="no vision encoder"):
        find("llama-3.1-8b").profile().with_images(1)
    with pytest.raises(PlanError, match="plus 512 image tokens"):
        make_plan(find("gemma-3-4b").profile().with_images(2), resolve_cluster(H100), Request(131072 - 100))


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from vision_models import save_tiny_gemma3_vision

    return save_tiny_gemma3_vision(tmp_path_factory.mktemp("vlm"))


def test_a_checkpoint_vision_tensors_are_counted_from_the_file(tiny_vlm: Path) -> None:
    from vision_models import MM_TOKENS, tiny_gemma3_vision

    model = tiny_gemma3_vision().model
    expected = sum(p.numel() for m in (model.vision_tower, model.multi_modal_projector) for p in m.parameters())
    profile = resolve(str(tiny_vlm))
    assert profile.vision is not None
    assert (profile.vision.params, profile.vision.stored_bytes) == (expected, expected * 4)  # fp32 file
    assert profile.vision.tokens_per_image == MM_TOKENS
    weights, kv = runner_formats("torch", "cpu")
    plan = _plan(profile, CPU, 64, 2, images=3, formats=(weights, kv))
    mem = plan.chosen.memory  # type: ignore[union-attr]
    assert mem.vision_weights == expected * 4
    assert mem.image_kv == 2 * 3 * MM_TOKENS * mem.kv_bytes_per_token


def _write_mmproj(path: Path, tensors: dict[str, np.ndarray], keys: dict[str, int | str]) -> None:
    import gguf

    w = gguf.GGUFWriter(path, "clip")
    for key, value in keys.items():
        if isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_uint32(key, value)
    for name, array in tensors.items():
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_an_mmproj_beside_a_gguf_is_counted(tmp_path: Path) -> None:
    from fixtures_models import hf_model, write_gguf_like_llamacpp

    model = tmp_path / "tiny.gguf"
    write_gguf_like_llamacpp("gemma3", hf_model("gemma3"), model)
    assert resolve(str(model)).vision is None
    tensors: dict[str, np.ndarray] = {"v.patch_embd.weight": np.zeros((32, 3, 14, 14), np.float16),
               "mm.input_projection.weight": np.zeros((64, 32), np.float32)}
    _write_mmproj(tmp_path / "mmproj-tiny-f16.gguf", tensors,
                  {"clip.projector_type": "gemma3", "clip.vision.image_size": 896, "clip.vision.patch_size": 14})
    vision = resolve(str(model)).vision
    assert vision is not None
    assert vision.params == 32 * 3 * 14 * 14 + 64 * 32
    assert vision.stored_bytes == 32 * 3 * 14 * 14 * 2 + 64 * 32 * 4
    assert vision.tokens_per_image == 256  # 64 x 64 patches pooled 4 x 4, as llama.cpp's Gemma 3 projector


def test_twinfer_plan_reports_encoder_weights_and_image_kv(capsys: pytest.CaptureFixture[str]) -> None:
    from twinfer.cli.plan_cmd import PlanOptions, run_plan

    run_plan(PlanOptions("gemma-3-4b", H100, context=4096, concurrency=3, images=2))
    out = capsys.readouterr().out
    assert "  vision       840 MB  (encoder + projector, 420M parameters)" in out
    assert "  image KV     214 MB  (256 tokens/image x 2 image(s) x 3 sequence(s))" in out
    run_plan(PlanOptions("gemma-3-4b", H100, images=2, json_out=True))
    memory = json.loads(capsys.readouterr().out)["memory"]
    assert memory["vision_weights_bytes_per_device"] == 419_816_304 * 2
    run_plan(PlanOptions("llama-3.1-8b", H100))
    assert "vision" not in capsys.readouterr().out
