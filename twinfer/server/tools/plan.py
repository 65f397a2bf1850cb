"""How one chat request's tools are served: `plan_tools` returns a `ToolPlan` (template tools or the
generic form, a constraint for `tool_choice`, a fresh parser per choice) (docs/internals.md, "Tool calls")."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from twinfer.runtime.constraints.spec import Constraint
from twinfer.runtime.errors import RequestError
from twinfer.server.tools.events import OutputParser, PlainText
from twinfer.server.tools.families import auto_grammar, call_grammar, family_of, generic_messages, thinks
from twinfer.server.tools.parsers import parser_for
from twinfer.server.tools.reasoning import ReasoningParser, after_thinking


@dataclass
class ToolPlan:
    family: str | None = None
    functions: dict[str, dict[str, Any]] = field(default_factory=dict)
    template_tools: list[dict[str, Any]] | None = None
    constraint: Constraint | None = None
    rewrite: Callable[[list[dict[str, Any]]], list[dict[str, Any]]] | None = None
    reasoning: bool = False

    @classmethod
    def none(cls) -> ToolPlan:
        return cls()

    @property
    def cuts(self) -> bool:
        """Whether its parser reads every delta (it may stop the request once the calls are over)."""
        return self.family is not None

    def parser(self) -> OutputParser:
        inner: OutputParser = PlainText()
        if self.family is not None:
            inner = parser_for(self.family, set(self.functions))
        return ReasoningParser(inner) if self.reasoning else inner


def plan_tools(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None,
               parallel: bool | None, tokenizer: Any, constraint: Constraint | None) -> ToolPlan:
    """The plan for a request; RequestError (the server's 400) names what is wrong."""
    template = getattr(tokenizer, "chat_template", None) or ""
    reasoning = thinks(template)
    choice = _choice(tool_choice, bool(tools))
    family = family_of(template)
    if not tools or choice == "none":  # harmony's channels are parsed even without tools
        return ToolPlan("harmony" if family == "harmony" else None, reasoning=reasoning,
                        constraint=_thinking_first(constraint, reasoning))
    functions = _functions(tools)
    if isinstance(choice, dict):
        name = choice["name"]
        if name not in functions:
            raise RequestError(f"tool_choice names the function {name!r}, which is not in tools "
                               f"({', '.join(functions)})", field="tool_choice")
        forced = {name: functions[name]}
    else:
        forced = functions if choice == "required" else {}
    if forced and constraint is not None:
        raise RequestError("tool_choice 'required' or a named function cannot be combined with response_format", field="tool_choice")
    plan = ToolPlan(family, functions, reasoning=reasoning)
    if family == "generic":
        plan.rewrite = generic_messages(list(functions.values()), parallel is not False)
    else:
        plan.template_tools = [{"type": "function", "function": f} for f in functions.values()]
    if forced:
        plan.constraint = Constraint("llguidance", call_grammar(family, list(forced.values()), parallel is not False))
    elif constraint is None:  # auto: a call the model opens is held to its function's schema
        grammar = auto_grammar(family, list(functions.values()))
        plan.constraint = Constraint("llguidance", grammar) if grammar else None
    else:
        plan.constraint = constraint
    plan.constraint = _thinking_first(plan.constraint, reasoning)
    return plan


def _thinking_first(constraint: Constraint | None, reasoning: bool) -> Constraint | None:
    """A thinking model's constraint starts once its reasoning ends."""
    return after_thinking(constraint) if constraint is not None and reasoning else constraint


def _choice(tool_choice: str | dict[str, Any] | None, have_tools: bool) -> str | dict[str, Any]:
    if tool_choice is None:
        return "auto" if have_tools else "none"
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise RequestError(f"tool_choice {tool_choice!r} is unknown; use none, auto, required or "
                               "{'type': 'function', 'function': {'name': ...}}", field="tool_choice")
        if tool_choice != "none" and not have_tools:
            raise RequestError(f"tool_choice {tool_choice!r} needs tools", field="tool_choice")
        return tool_choice
    fn = tool_choice.get("function") if tool_choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else tool_choice.get("name")
    if not isinstance(name, str):
        raise RequestError("a named tool_choice is {'type': 'function', 'function': {'name': ...}}", field="tool_choice")
    if not have_tools:
        raise RequestError("tool_choice names a function but the request has no tools", field="tool_choice")
    return {"name": name}


def _functions(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """name -> {"name", "description", "parameters"} of every function tool, checked."""
    out: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise RequestError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}", field="tools")
        name = fn.get("name")
        if not isinstance(name, str) or not name or len(name) > 64:
            raise RequestError(f"tools[{i}].function.name must be a non-empty string of at most 64 characters", field="tools")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise RequestError(f"tools[{i}].function.parameters must be a JSON schema object", field="tools")
        if name in out:
            raise RequestError(f"tools[{i}]: the function {name!r} is defined twice", field="tools")
        entry = {"name": name, "parameters": params}
        if isinstance(fn.get("description"), str):
            entry["description"] = fn["description"]
        out[name] = entry
    json.dumps(out)  # plain JSON only (the template and the grammar both serialize it)
    return out
