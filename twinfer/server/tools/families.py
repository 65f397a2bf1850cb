"""Tool-call families: which one a chat template speaks (read from its text), its call grammar, and the
generic form for templates without tools (docs/api.md)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from typing import Any

from twinfer.runtime.constraints.spec import JSON_OPTIONS, bounded_integers

GENERIC_INSTRUCTIONS = """You can call these functions (each with a JSON Schema of its arguments):
{tools}
To call {how}, reply with only this JSON and nothing else:
{{"tool_calls": [{{"name": "<function name>", "arguments": {{<arguments as a JSON object>}}}}]}}
A function's result comes back in the next message. When you have the results you need, or need no
function, reply in plain text."""


# A forced reply holds at most this many calls: a base model given room for parallel calls repeats
# them until max_tokens (Gemma 3 270M does), so the grammar ends the list.
MAX_PARALLEL_CALLS = 8


def family_of(template: str) -> str:
    if "<|channel|>" in template:
        return "harmony"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or ("<|start_header_id|>" in template and "tools" in template):
        return "llama3"
    return "generic"


def thinks(template: str) -> bool:
    """Whether the model reasons in <think> blocks before it answers."""
    return "<think>" in template or "</think>" in template


def _call_schema(fn: dict[str, Any], args_key: str = "arguments") -> dict[str, Any]:
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, args_key: fn["parameters"]},
            "required": ["name", args_key], "additionalProperties": False}


def _any_call(functions: list[dict[str, Any]], args_key: str = "arguments") -> dict[str, Any]:
    calls = [_call_schema(f, args_key) for f in functions]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def _json(schema: dict[str, Any]) -> str:
    return "%json " + json.dumps({**bounded_integers(schema), "x-guidance": JSON_OPTIONS})


def call_grammar(family: str, functions: list[dict[str, Any]], parallel: bool) -> str:
    """An llguidance grammar (JSON form) admitting only calls of `functions` in `family`'s syntax."""
    most = MAX_PARALLEL_CALLS if parallel else 1
    many = f"{{1,{most}}}" if most > 1 else ""
    if family == "harmony":
        return json.dumps({"grammars": [{"lark_grammar": harmony_call_grammar(functions)}]})
    if family == "hermes":
        lark = f'start: call{many}\ncall: "<tool_call>\\n" {_json(_any_call(functions))} "\\n</tool_call>"\n'
    elif family == "llama3":
        lark = f"start: {_json(_any_call(functions, 'parameters'))}\n"
    else:
        array = {"type": "array", "items": _any_call(functions), "minItems": 1, "maxItems": most}
        if family == "mistral":
            lark = f'start: "[TOOL_CALLS]" {_json(array)}\n'
        else:
            outer = {"type": "object", "properties": {"tool_calls": array}, "required": ["tool_calls"],
                     "additionalProperties": False}
            lark = f"start: {_json(outer)}\n"
    return json.dumps({"grammars": [{"lark_grammar": lark}]})


def harmony_call_grammar(functions: list[dict[str, Any]]) -> str:
    """gpt-oss's forced call: optional analysis, then one commentary message to `functions.NAME` with
    `<|constrain|>json` arguments, ending on `<|call|>` (one call per turn)."""
    calls = [f'<|channel|> "commentary to=functions.{f["name"]} " <|constrain|> "json" <|message|> '
             f'{_json(f["parameters"])}' for f in functions]
    return ('start: analysis? call\n'
            'analysis: <|channel|> "analysis" <|message|> /(.|\n)*/ <|end|> <|start|> "assistant"\n'
            f'call: {" | ".join(calls)}\n')


_TRIGGERS = {"hermes": ("<tool_call>", '<tool_call>\n{{"name": "{name}", "arguments": ', "}\n</tool_call>"),
             "generic": ('{"tool_calls": [', '{{"tool_calls": [{{"name": "{name}", "arguments": ', "}]}")}


def auto_grammar(family: str, functions: list[dict[str, Any]]) -> str | None:
    """For tool_choice "auto": free text, but once the model opens a call (its family's trigger),
    the function name and its arguments are held to the schema. None for families without one."""
    if family not in _TRIGGERS:
        return None
    from llguidance import StructTag

    trigger, begin, end = _TRIGGERS[family]
    tags = [StructTag(trigger=trigger, begin=begin.format(name=f["name"]), end=end,
                      grammar={**bounded_integers(f["parameters"]), "x-guidance": JSON_OPTIONS}) for f in functions]
    return str(StructTag.to_grammar(tags, assume_special=False))


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


def generic_messages(functions: list[dict[str, Any]], parallel: bool
                     ) -> Callable[[list[dict[str, Any]]], list[dict[str, Any]]]:
    """The rewrite of a conversation into the generic form (plain system/user/assistant turns)."""
    how = "one or more functions" if parallel else "a function"
    system = GENERIC_INSTRUCTIONS.format(tools=json.dumps(functions, ensure_ascii=False), how=how)

    def rewrite(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        names: dict[str, str] = {}  # tool_call_id -> function name, for the results that follow
        for m in messages:
            for c in m.get("tool_calls") or [] if m.get("role") == "assistant" else []:
                if isinstance(c, dict) and isinstance(c.get("id"), str):
                    names[c["id"]] = (c.get("function") or {}).get("name", "")
            m = _plain_turn(m, names)
            if out and out[-1]["role"] == m["role"] == "user":
                out[-1] = {"role": "user", "content": out[-1]["content"] + "\n\n" + m["content"]}
            else:
                out.append(m)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": system + "\n\n" + out[0]["content"]}
        else:
            out.insert(0, {"role": "system", "content": system})
        return out

    return rewrite


def _plain_turn(m: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    role = m.get("role")
    if role == "assistant" and m.get("tool_calls"):
        calls = []
        for c in m["tool_calls"]:
            fn = c.get("function", {}) if isinstance(c, dict) else {}
            args = fn.get("arguments", {})
            if isinstance(args, str):
                with contextlib.suppress(ValueError):  # not JSON: the model sees it as written
                    args = json.loads(args) if args.strip() else {}
            calls.append(f"{fn.get('name')}({json.dumps(args, ensure_ascii=False)})")
        # Past calls read as prose: a small model copies a JSON call it sees in the history, and would
        # call again instead of answering from the result that follows.
        said = _text(m.get("content")).strip()
        return {"role": "assistant", "content": (said + "\n" if said else "") + f"I called {' and '.join(calls)}."}
    if role == "tool":
        name = m.get("name") or names.get(m.get("tool_call_id") or "", "")
        who = f" {name}" if name else ""
        return {"role": "user", "content": f"The function{who} returned: {_text(m.get('content'))}\n"
                                           "Now answer in plain text, using this result."}
    return {**m, "content": _text(m.get("content"))}
