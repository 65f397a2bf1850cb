"""gpt-oss chat prompts in the harmony format, rendered as openai-harmony renders them (checked against
its golden renderings) without downloading its vocabulary; what a request becomes: docs/internals.md,
"Harmony prompts"."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from twinfer.runtime.errors import RequestError
from twinfer.runtime.tokenizer.chat import validate_messages

IDENTITY = "You are ChatGPT, a large language model trained by OpenAI."
KNOWLEDGE_CUTOFF = "2024-06"
EFFORTS = ("low", "medium", "high")


def render_harmony(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None,
                   add_generation_prompt: bool = True, reasoning_effort: str | None = None,
                   current_date: str | None = None, model_identity: str = IDENTITY) -> str:
    """The harmony prompt text of a chat request (see the module doc); RequestError names a bad field."""
    effort = reasoning_effort or "medium"
    if effort not in EFFORTS:
        raise RequestError(f"reasoning_effort {effort!r} is unknown; use low, medium or high")
    chat = validate_messages([{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages])
    functions = [t.get("function", t) for t in tools or ()]
    instructions = "\n\n".join(m["content"] for m in chat if m["role"] == "system" and m.get("content"))
    out = [_message("system", system_content(effort, bool(functions), current_date, model_identity))]
    if instructions or functions:
        out.append(_message("developer", developer_content(instructions, functions)))
    out += _turns([m for m in chat if m["role"] != "system"])
    if add_generation_prompt:
        out.append("<|start|>assistant")
    return "".join(out)


def system_content(effort: str, has_functions: bool, current_date: str | None = None,
                   model_identity: str = IDENTITY) -> str:
    top = [model_identity, f"Knowledge cutoff: {KNOWLEDGE_CUTOFF}"]
    if current_date:
        top.append(f"Current date: {current_date}")
    channels = "# Valid channels: analysis, commentary, final. Channel must be included for every message."
    if has_functions:
        channels += "\nCalls to these tools must go to the commentary channel: 'functions'."
    return "\n\n".join(["\n".join(top), f"Reasoning: {effort}", channels])


def developer_content(instructions: str, functions: Sequence[Mapping[str, Any]]) -> str:
    sections = ["# Instructions", instructions] if instructions else []
    if functions:
        sections.append(tools_section(functions))
    return "\n\n".join(sections)


def tools_section(functions: Sequence[Mapping[str, Any]]) -> str:
    lines = ["## functions\n", "namespace functions {\n"]
    for fn in functions:
        lines += [f"// {line}" for line in str(fn.get("description") or "").splitlines()]
        params = fn.get("parameters")
        if params and (params.get("properties") or params.get("type") != "object"):
            lines.append(f"type {fn['name']} = (_: {to_typescript(params, '')}) => any;\n")
        else:  # no arguments
            lines.append(f"type {fn['name']} = () => any;\n")
    lines.append("} // namespace functions")
    return "# Tools\n\n" + "\n".join(lines)


def _message(role: str, content: str, header: str = "", end: str = "<|end|>") -> str:
    return f"<|start|>{role}{header}<|message|>{content}{end}"


def _turns(chat: list[dict[str, Any]]) -> list[str]:
    out: list[str] = []
    names: dict[str, str] = {}  # tool_call_id -> function name, for the tool messages that answer
    last_assistant = next((m for m in reversed(chat) if m["role"] == "assistant"), None)
    chain_open = last_assistant is not None and bool(last_assistant.get("tool_calls"))  # no final answer yet
    for m in chat:
        role = m["role"]
        if role == "user":
            out.append(_message("user", m.get("content") or ""))
        elif role == "assistant":
            calls = m.get("tool_calls") or []
            if m.get("reasoning_content") and calls and chain_open:
                out.append(_message("assistant", m["reasoning_content"], "<|channel|>analysis"))
            if m.get("content"):
                channel = "commentary" if calls else "final"
                out.append(_message("assistant", m["content"], f"<|channel|>{channel}"))
            for c in calls:
                fn = c["function"]
                names[str(c.get("id"))] = fn["name"]
                args = fn.get("arguments")
                body = args if isinstance(args, str) else json.dumps(args if args is not None else {},
                                                                     ensure_ascii=False)
                out.append(_message("assistant", body, f" to=functions.{fn['name']}<|channel|>commentary "
                                    "<|constrain|>json", "<|call|>"))
        elif role == "tool":
            name = m.get("name") or names.get(str(m.get("tool_call_id")))
            if not name:
                raise RequestError("a tool message needs the name of its function, or a tool_call_id of an "
                                   "earlier assistant call")
            out.append(_message(f"functions.{name}", m.get("content") or "", " to=assistant<|channel|>commentary"))
    return out


def _is_enum(schema: Mapping[str, Any]) -> bool:
    return isinstance(schema.get("enum"), list) and bool(schema["enum"])


def _default(schema: Mapping[str, Any]) -> str:
    d = schema["default"]
    if isinstance(d, str):
        return f"default: {d}" if _is_enum(schema) else f'default: "{d}"'
    return f"default: {json.dumps(d, separators=(',', ':'))}"


def _nullable(schema: Mapping[str, Any], text: str) -> str:
    return f"{text} | null" if schema.get("nullable") is True and "null" not in text else text


def _variants(variants: list[Any], indent: str, skip_first_description: bool = False,
              parent_description: str | None = None) -> list[str]:
    out = []
    for i, v in enumerate(variants):
        text = _nullable(v, to_typescript(v, indent + "   "))
        notes = []
        desc = v.get("description")
        if isinstance(desc, str) and not (i == 0 and skip_first_description) and desc != parent_description:
            notes.append(desc)
        if "default" in v:
            notes.append(_default(v))
        out.append(f"{indent} | {text}" + (f" // {' '.join(notes)}" if notes else ""))
    return out


def to_typescript(schema: Mapping[str, Any], indent: str) -> str:
    """A JSON schema as the type harmony shows the model."""
    if isinstance(schema.get("oneOf"), list):
        return "\n" + "\n".join(_variants(schema["oneOf"], indent))
    kind = schema.get("type")
    if isinstance(kind, list):
        names = ["number" if t == "integer" else t for t in kind if isinstance(t, str)]
        if names:
            return " | ".join(names)
    if kind == "object":
        return _object(schema, indent)
    if kind == "string":
        if _is_enum(schema):
            options = [f'"{v}"' for v in schema["enum"] if isinstance(v, str)]
            if options:
                return " | ".join(options)
        return "string"
    if kind in ("number", "integer"):
        return "number"
    if kind == "boolean":
        return "boolean"
    if kind == "array":
        return f"{to_typescript(schema['items'], indent)}[]" if "items" in schema else "Array<any>"
    return "any"


def _object(schema: Mapping[str, Any], indent: str) -> str:
    out = f"{indent}// {schema['description']}\n" if isinstance(schema.get("description"), str) else ""
    out += "{\n"
    required = set(schema.get("required") or ())
    for key, val in (schema.get("properties") or {}).items():
        mark = "" if key in required else "?"
        if isinstance(val.get("title"), str):
            out += f"{indent}// {val['title']}\n{indent}//\n"
        one_of = val.get("oneOf") if isinstance(val.get("oneOf"), list) else None
        desc = val.get("description") if isinstance(val.get("description"), str) else None
        if one_of is None and desc is not None:
            out += f"{indent}// {desc}\n"
        if isinstance(val.get("examples"), list) and val["examples"]:
            out += f"{indent}// Examples:\n" + "".join(f'{indent}// - "{e}"\n' for e in val["examples"]
                                                       if isinstance(e, str))
        if one_of is not None:
            skip = desc is not None and bool(one_of) and one_of[0].get("description") == desc
            above = desc is not None and not skip
            if above:
                out += f"{indent}// {desc}\n"
            if "default" in val:
                out += f"{indent}// {_default(val)}\n"
            out += f"{indent}{key}{mark}:\n" + "".join(line + "\n" for line in _variants(one_of, indent, above, desc))
            out += f"{indent},\n"
            continue
        out += f"{indent}{key}{mark}: {_nullable(val, to_typescript(val, indent + '    '))},"
        if "default" in val:
            out += f" // {_default(val)}"
        out += "\n"
    return out + f"{indent}}}"
