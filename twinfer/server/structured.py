"""Structured-output fields of a request -> the one `Constraint` the engine enforces: OpenAI's
`response_format`, vLLM's `structured_outputs` and `guided_*`, llama-server's `json_schema`/`grammar`
(docs/api.md). Two constraints in one request are a 400."""

from __future__ import annotations

from typing import Any

from twinfer.runtime.constraints.spec import Constraint, GrammarError
from twinfer.server.errors import APIError

_VLLM_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "gbnf"}


def constraint_of(body: Any) -> Constraint | None:
    """The request's constraint, or None; APIError (400) for a malformed or doubled one."""
    found: list[tuple[str, Constraint]] = []
    _response_format(body, found)
    _vllm(body, found)
    _llama_server(body, found)
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise APIError(400, f"the request has more than one output constraint ({names}); send one",
                       param=found[1][0])
    return found[0][1] if found else None


def _response_format(body: Any, found: list[tuple[str, Constraint]]) -> None:
    fmt = getattr(body, "response_format", None)
    if fmt is None or fmt.type == "text":
        return
    extra = fmt.model_extra or {}
    if fmt.type == "json_object":
        found.append(("response_format", Constraint("json_object", "")))
    elif fmt.type == "json_schema":
        spec = extra.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec and "json_schema" not in spec:
            raise APIError(400, "response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}",
                           param="response_format.json_schema")
        found.append(("response_format", make_constraint("json_schema", spec.get("schema", spec.get("json_schema")),
                                               "response_format.json_schema.schema")))
    else:
        raise APIError(400, f"response_format type {fmt.type!r} is unknown; use 'text', 'json_object' or "
                       "'json_schema'", param="response_format.type")


def _vllm(body: Any, found: list[tuple[str, Constraint]]) -> None:
    so = getattr(body, "structured_outputs", None)
    if so:
        for key, kind in _VLLM_KEYS.items():
            if so.get(key) is not None:
                found.append((f"structured_outputs.{key}", make_constraint(kind, so[key], f"structured_outputs.{key}")))
        if so.get("json_object"):
            found.append(("structured_outputs.json_object", Constraint("json_object", "")))
    for name, kind in (("guided_json", "json_schema"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "gbnf")):
        value = getattr(body, name, None)
        if value is not None:
            found.append((name, make_constraint(kind, value, name)))


def _llama_server(body: Any, found: list[tuple[str, Constraint]]) -> None:
    schema = getattr(body, "json_schema", None)
    if schema is not None:
        found.append(("json_schema", make_constraint("json_schema", schema, "json_schema")))
    grammar = getattr(body, "grammar", None)
    if grammar:
        found.append(("grammar", make_constraint("gbnf", grammar, "grammar")))


def make_constraint(kind: str, value: Any, param: str) -> Constraint:
    """A Constraint from a request field; a 400 naming `param` when the value cannot be one."""
    try:
        if kind == "json_schema":
            return Constraint.json_schema(value)
        if kind == "choice":
            return Constraint.choice(value)
        if not isinstance(value, str) or not value:
            raise GrammarError(f"a {kind} constraint must be a non-empty string")
        return Constraint(kind, value)
    except GrammarError as e:
        raise APIError(400, f"{param}: {e}", param=param, code="invalid_grammar") from e
