"""The layers import only downward, proven from the AST of every module (function-local imports too).

runtime (the core) imports nothing above it; quant measures through runners it is handed and never
imports a backend; planners never touch a device; backends never reach up into the application;
the app layer is the one place that knows every other. formats is the leaf under all of them: numpy
only, importing nothing else from twinfer. A string handed to `importlib` counts too.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

import twinfer

PACKAGE = Path(twinfer.__file__).parent
FACES = ("cli", "tui", "server")
FORBIDDEN = {  # layer -> the layers it must never import
    "formats": ("runtime", "planners", "quant", "backends", "app", *FACES),
    "runtime": ("planners", "quant", "backends", "app", *FACES),
    "quant": ("backends", "app", *FACES),
    "planners": ("backends", "app", *FACES),
    "backends": ("app", *FACES),
    "app": FACES,
}


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path, module_name: str | None = None) -> list[tuple[int, str]]:
    """(line, module) of every import in the file, wherever it sits; relative imports made absolute."""
    here = (module_name or _module(path)).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            out.append((node.lineno, module))
            out += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]  # `from twinfer import app`
        elif _is_import_module(node):
            out.append((node.lineno, node.args[0].value))  # type: ignore[attr-defined]
    return out


def _is_import_module(node: ast.AST) -> bool:
    """`importlib.import_module("twinfer....")` with a literal name."""
    if not isinstance(node, ast.Call) or getattr(node.func, "attr", getattr(node.func, "id", "")) != "import_module":
        return False
    return bool(node.args) and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "twinfer" else None


def upward_imports() -> dict[str, list[str]]:
    """layer -> "file:line imports module" for every import that climbs."""
    found: dict[str, list[str]] = {layer: [] for layer in FORBIDDEN}
    for path in sorted(PACKAGE.rglob("*.py")):
        layer = _layer(_module(path))
        if layer not in FORBIDDEN:
            continue
        for line, module in imported(path):
            if _layer(module) in FORBIDDEN[layer]:
                found[layer].append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {module}")
    return found


def test_the_checker_sees_function_local_relative_and_string_imports(tmp_path: Path) -> None:
    sample = PACKAGE / "runtime" / "engine" / "engine.py"
    assert any(m.startswith("twinfer.runtime.kv") for _, m in imported(sample))
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    import twinfer.backends.cuda\n    from twinfer import quant\n"
                     "    from ..planners import plan\n    importlib.import_module('twinfer.app')\n")
    assert [m for _, m in imported(probe, "twinfer.runtime.probe")] == [
        "twinfer.backends.cuda", "twinfer", "twinfer.quant", "twinfer.planners", "twinfer.planners.plan", "twinfer.app"]


def test_runtime_imports_nothing_above_it() -> None:
    assert upward_imports()["runtime"] == []


def test_runtime_holds_no_web_server() -> None:
    """The HTTP server, its protocol models and the tool-call parsers are a face above the core."""
    web = ("fastapi", "starlette", "uvicorn", "httpx", "pydantic")
    found = [f"{p.relative_to(PACKAGE.parent)} imports {m}" for p in sorted((PACKAGE / "runtime").rglob("*.py"))
             for _, m in imported(p) if m.split(".")[0] in web]
    assert found == []


def test_quant_never_imports_a_backend() -> None:
    assert upward_imports()["quant"] == []


def test_formats_is_a_leaf_of_numpy() -> None:
    """Element tables and codecs every layer reads: importing anything but numpy, the standard library
    or itself would make one of its importers import more than it declares."""
    assert upward_imports()["formats"] == []
    found = [f"{p.name}:{line} imports {m}" for p in sorted((PACKAGE / "formats").rglob("*.py"))
             for line, m in imported(p)
             if m.split(".")[0] not in ("numpy", "__future__", *sys.stdlib_module_names)
             and not m.startswith("twinfer.formats")]
    assert found == []


# The E2M1 code -> value table, however it is spelled (0 or 0.0, ints or floats).
_E2M1_LIST = re.compile(r"\[\s*0(\.0)?,\s*0\.5,\s*1(\.0)?,\s*1\.5,\s*2(\.0)?,\s*3(\.0)?,\s*4(\.0)?,\s*6(\.0)?,\s*-0")


def test_the_e2m1_table_is_written_once_in_formats() -> None:
    found = [p.relative_to(PACKAGE).as_posix() for p in sorted(PACKAGE.rglob("*.py"))
             if _E2M1_LIST.search(p.read_text())]
    assert found == ["formats/e2m1.py"]


def test_planners_backends_and_app_import_only_downward() -> None:
    found = upward_imports()
    assert (found["planners"], found["backends"], found["app"]) == ([], [], [])


# Files outside runtime/models that may spell a registered architecture's name, and why.
NAMES_ALLOWED = {
    "planners/catalog.py": "the built-in catalog of published models states each one's architecture",
    "runtime/models/__init__.py": "the registry itself (MODEL_TYPES, GGUF_ARCHS)",
    "runtime/tokenizer/convert.py": "llama.cpp's vocabulary names: tokenizer.ggml.model 'llama' (SentencePiece), "
                                    "tokenizer.ggml.pre 'qwen2' (a pre-tokenizer), not model types",
    "server/tools/families.py": "'mistral' is a tool-call format ([TOOL_CALLS]), found from the chat template",
    "server/tools/parsers.py": "'mistral' is that tool-call format's parser",
}


def architecture_names_outside_models() -> list[str]:
    """`file:line 'name'` for every string constant outside runtime/models that is a registered
    model_type or GGUF architecture name (docstrings and comments may mention models)."""
    from twinfer.runtime.models import GGUF_ARCHS, MODEL_TYPES

    names = set(MODEL_TYPES) | set(GGUF_ARCHS)
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel in NAMES_ALLOWED or (rel.startswith("runtime/models/") and rel != "runtime/models/__init__.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
                found.append(f"{rel}:{node.lineno} {node.value!r}")
    return found


def test_only_architecture_files_name_architectures() -> None:
    """Adding an architecture is one file: what is particular to it (name tables, chat template,
    synthetic checkpoints, GGUF names) lives in runtime/models/<model_type>.py, found through the registry."""
    assert architecture_names_outside_models() == []


def test_the_name_checker_sees_a_model_type(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    probe = tmp_path / "twinfer" / "quant" / "probe.py"
    probe.parent.mkdir(parents=True)
    probe.write_text('"""gpt_oss in a docstring is fine."""\nif arch == "gpt-oss":\n    pass\n')
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path / "twinfer")
    assert architecture_names_outside_models() == ["quant/probe.py:2 'gpt-oss'"]
