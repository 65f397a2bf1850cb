"""The code's structure, read from the AST of twinfer/: one construction site per backend, faces that
reach runners only through `open_session`."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "twinfer"
# every function a backend builds a runner with, by backend
BUILDERS = {
    "llamacpp": ("LlamaCppRunner",),
    "torch": ("open_torch_runner", "build_torch_runner", "open_parallel", "load_streaming_torch_runner"),
    "mlx": ("load_mlx_runner", "build_mlx_runner", "load_streaming_mlx_runner"),
}
FACES = ("cli", "tui", "server")
# what opens a model below open_session: a face calling one of these has a second way to a runner
BELOW_SESSION = ("open_model", "open_loaded", "open_runner", "fit_budget")


def _modules() -> Iterator[tuple[str, ast.Module]]:
    for path in sorted(ROOT.rglob("*.py")):
        yield path.relative_to(ROOT.parent).as_posix(), ast.parse(path.read_text(), str(path))


def _called(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            names.add(f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else "")
    return names


def test_each_backend_builds_its_runner_in_one_place() -> None:
    """Outside the backends themselves, only app/models.py calls a runner builder: a second call site is
    where a path's options (KV layout, repacking, exact mode) get dropped."""
    callers: dict[str, set[str]] = {name: set() for names in BUILDERS.values() for name in names}
    for module, tree in _modules():
        if module.startswith("twinfer/backends/"):
            continue
        for name in _called(tree) & callers.keys():
            callers[name].add(module)
    assert callers == {name: {"twinfer/app/models.py"} for name in callers}


def test_faces_reach_runners_only_through_open_session() -> None:
    seen = {module: sorted(_called(tree) & set(BELOW_SESSION)) for module, tree in _modules()
            if module.split("/")[1] in FACES}
    assert {m: names for m, names in seen.items() if names} == {}
    assert any("open_session" in _called(tree) for m, tree in _modules() if m == "twinfer/cli/serve_cmd.py")


# -- functions that want an options object ----------------------------------------------------------
MANY = 10  # parameters (self and cls not counted) at which a function wants an object (STYLE.md, rule 18)
# Still taking ten or more: MlxStates.gated_delta, to take the step (MlxStep) as TorchStates.gated_delta
# does. The list may only shrink. Triton kernels (`@triton.jit`) are excepted in `many_parameter_functions`.
PENDING: set[str] = set()


def _decorated(node: ast.FunctionDef | ast.AsyncFunctionDef, attr: str) -> bool:
    """Decorated with `x.<attr>` or `x.<attr>(...)` (typer's `app.command()`, triton's `triton.jit`)."""
    for d in node.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        if isinstance(target, ast.Attribute) and target.attr == attr:
            return True
    return False


def _parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = node.args
    names = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    return len(names) - (names[:1] in (["self"], ["cls"])) + (a.vararg is not None) + (a.kwarg is not None)


def many_parameter_functions() -> tuple[list[str], list[str]]:
    """(`module:function` of every function with MANY or more parameters, the typer commands among them).

    Excepted: triton kernels, whose parameters are what a launch passes (pointers, strides, constexprs;
    triton takes no objects)."""
    found, commands = [], []
    for module, tree in _modules():
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or _parameters(node) < MANY:
                continue
            if _decorated(node, "jit"):
                continue
            name = f"{module}:{node.name}"
            is_command = module.startswith("twinfer/cli/") and _decorated(node, "command")
            (commands if is_command else found).append(name)
    return sorted(found), sorted(commands)


def test_no_function_takes_ten_parameters() -> None:
    """A command's flags become one options object built once; everything a typer command calls takes it.
    The typer commands themselves take one parameter per flag (typer reads the signature)."""
    found, commands = many_parameter_functions()
    assert [f for f in found if f not in PENDING] == []
    assert commands and all(c.startswith("twinfer/cli/main.py:") for c in commands)
