"""One checkpoint's frozen vision encoder before another's language model of the same width, named by a
file `{"vision": PATH, "language": PATH}` (docs/images.md, "Composing a vision encoder")."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from twinfer.runtime.errors import BackendUnavailable, ModelError
from twinfer.runtime.runner import OpsRunner, Runner
from twinfer.runtime.spec import ModelSpec
from twinfer.runtime.vision import VisionTower

SUFFIXES = (".json", ".toml")
KEYS = ("vision", "language")


@dataclass(frozen=True)
class Composition:
    """The two checkpoints and the `source` file that named them."""

    vision: Path
    language: Path
    source: Path


def read_composition(path: Path) -> Composition | None:
    """The composition a `.json`/`.toml` file names; None for any other path (config.json included)."""
    if not path.is_file() or path.suffix.lower() not in SUFFIXES or path.name == "config.json":
        return None
    data = _parse(path)
    if not isinstance(data, dict) or not any(k in data for k in KEYS):
        return None
    unknown = sorted(set(data) - set(KEYS))
    missing = [k for k in KEYS if not isinstance(data.get(k), str) or not data[k]]
    if unknown or missing:
        raise ModelError(f"{path}: a composition names two model folders, e.g. "
                         '{"vision": "path/to/vision-language-model", "language": "path/to/language-model"}'
                         + (f"; unknown keys: {', '.join(unknown)}" if unknown else "")
                         + (f"; missing: {', '.join(missing)}" if missing else ""))
    base = path.parent
    vision, language = ((base / Path(data[k]).expanduser()).resolve() for k in KEYS)
    for key, folder in zip(KEYS, (vision, language), strict=True):
        if not folder.is_dir():
            raise ModelError(f"{path}: {key} {data[key]!r} is not a model folder ({folder} does not exist or is "
                             "a file); name a Hugging Face folder with config.json and *.safetensors")
    return Composition(vision, language, path)


def _parse(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
        if path.suffix.lower() == ".json":
            return json.loads(text)
        import tomllib

        return tomllib.loads(text)
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot read {path}: {e}") from e


def vision_width(composition: Composition) -> int:
    """The projector's output width: the vision checkpoint's own language model's."""
    from twinfer.runtime.loaders.hf import read_config, spec_from_config

    return spec_from_config(read_config(composition.vision)).hidden_size


def check_width(composition: Composition, language: ModelSpec) -> None:
    """Refuse a language model whose width differs from what the projector writes."""
    width = vision_width(composition)
    if width != language.hidden_size:
        raise ModelError(
            f"{composition.source}: the vision encoder of {composition.vision.name} projects images to "
            f"{width}-wide features, but the language model {composition.language.name} is "
            f"{language.hidden_size} wide; compose a language model of width {width}")


def attach_vision(runner: Runner, composition: Composition) -> VisionTower:
    """Open the vision checkpoint's tower over `runner`'s Ops and set it as `runner.vision`."""
    from twinfer.runtime.loaders.hf import read_config, spec_from_config
    from twinfer.runtime.models import architecture

    if not isinstance(runner, OpsRunner):
        raise BackendUnavailable(f"{composition.source}: a composed model runs on the torch or mlx runner, "
                                 f"not {runner.backend}")
    check_width(composition, runner.spec)
    config = read_config(composition.vision)
    arch = architecture(spec_from_config(config).model_type)
    opener = arch.vision if arch is not None else None
    tower = opener(composition.vision, config, runner.spec, runner.ops) if opener is not None else None
    if tower is None:
        raise ModelError(f"{composition.source}: {composition.vision} has no vision tower twinfer reads "
                         "(a checkpoint with vision_tower and multi_modal_projector tensors)")
    runner.vision = tower
    return tower
