"""Tool planning: the family read from a chat template, the generic form's rewrite, and the grammars
for tool_choice required / named / auto, checked token by token against an llguidance matcher."""

from __future__ import annotations

import pytest

pytest.importorskip("llguidance")

from test_constraints import char_tokenizer  # noqa: E402

from twinfer.runtime.constraints import Constraint, Grammars  # noqa: E402
from twinfer.runtime.constraints.mask import guide_for, row_masks  # noqa: E402
from twinfer.runtime.errors import RequestError  # noqa: E402
from twinfer.runtime.tokenizer import Tokenizer  # noqa: E402
from twinfer.server.tools.families import MAX_PARALLEL_CALLS, family_of  # noqa: E402
from twinfer.server.tools.plan import plan_tools  # noqa: E402

ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}}}
NOTE = {"type": "function", "function": {"name": "note", "description": "Save a note", "parameters": {
    "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return char_tokenizer()


def allowed_after(tok: Tokenizer, constraint: Constraint, text: str | tuple[str, ...]) -> str:
    """The characters the grammar allows after `text` ("" if `text` itself was refused)."""
    guide = guide_for(Grammars(tok, tok.vocab_size), constraint)
    pieces = (text,) if isinstance(text, str) else text
    ids = [i for piece in pieces for i in tok.encode(piece, add_special_tokens=False)]
    guide.advance(ids)
    if guide.consumed < len(ids):
        return ""
    mask = row_masks([guide], tok.vocab_size)[0].bools()
    return "".join(tok.decode([i]) for i in mask.nonzero()[0] if not tok.is_special(int(i)))


def test_family_from_template() -> None:
    assert family_of("{% for m in messages %}<tool_call>{{ m }}</tool_call>{% endfor %}") == "hermes"
    assert family_of("[AVAILABLE_TOOLS] [TOOL_CALLS]") == "mistral"
    assert family_of("<|start_header_id|>ipython {% if tools %}") == "llama3"
    assert family_of("<start_of_turn>user") == "generic"
    assert family_of("<|start|>assistant<|channel|>final<|message|>") == "harmony"


def test_generic_form_rewrites_the_conversation(tok: Tokenizer) -> None:
    plan = plan_tools([ADD, NOTE], "auto", None, tok, None)
    assert plan.family == "generic" and plan.template_tools is None and plan.rewrite is not None
    messages = plan.rewrite([
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "add 2"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "2"}, {"role": "tool", "tool_call_id": "c2", "content": "x"}])
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert '"name": "add"' in messages[0]["content"] and messages[0]["content"].endswith("be brief")
    assert messages[2]["content"] == 'I called add({"a": 2}).'  # prose: a small model copies a JSON call
    assert messages[3]["content"].count("Now answer in plain text, using this result.") == 2
    assert "The function add returned: 2" in messages[3]["content"]  # the result names its call
    hermes = type("T", (), {"chat_template": "<tool_call>{{ tools }}"})()
    plan = plan_tools([ADD], "auto", None, hermes, None)
    assert plan.template_tools == [{"type": "function", "function": ADD["function"]}] and plan.rewrite is None


def test_required_grammar_admits_only_schema_valid_calls(tok: Tokenizer) -> None:
    c = plan_tools([ADD, NOTE], "required", False, tok, None).constraint
    assert allowed_after(tok, c, "") == "{"
    assert allowed_after(tok, c, '{"tool_calls": [{"name": "') == "an"
    assert allowed_after(tok, c, '{"tool_calls": [{"name": "add", "arguments": {"a": ') == "-0123456789"
    assert allowed_after(tok, c, '{"tool_calls": [{"name": "add", "arguments": {"a": 1}}') == "]"  # not parallel
    assert allowed_after(tok, c, '{"tool_calls": [{"name": "sub"') == ""
    parallel = plan_tools([ADD], "required", None, tok, None).constraint
    one = '{"name": "add", "arguments": {"a": 1}}'
    assert allowed_after(tok, parallel, '{"tool_calls": [' + one) == ",]"
    assert allowed_after(tok, parallel, '{"tool_calls": [' + ", ".join([one] * MAX_PARALLEL_CALLS)) == "]"
    named = plan_tools([ADD, NOTE], {"type": "function", "function": {"name": "note"}}, None, tok, None).constraint
    assert allowed_after(tok, named, '{"tool_calls": [{"name": "') == "n"


def test_auto_grammar_is_free_until_a_call_opens(tok: Tokenizer) -> None:
    c = plan_tools([ADD], "auto", None, tok, None).constraint
    assert len(allowed_after(tok, c, "Any text at all, {braces} too")) > 90
    assert allowed_after(tok, c, 'Sure. {"tool_calls": [') == "{"
    assert allowed_after(tok, c, '{"tool_calls": [{"name": "add", "arguments": {"') == "a"
    assert allowed_after(tok, c, '{"tool_calls": [{"name": "add", "arguments": {"a": "') == ""  # not an integer


def test_bad_tool_requests(tok: Tokenizer) -> None:
    for tools, choice, needle in [([ADD], {"type": "function", "function": {"name": "nope"}}, "not in tools"),
                                  (None, "required", "needs tools"), ([ADD], "sometimes", "unknown"),
                                  ([ADD, ADD], "auto", "defined twice"), ([{"type": "code"}], "auto", r"tools\[0\]")]:
        with pytest.raises(RequestError, match=needle):
            plan_tools(tools, choice, None, tok, None)
    assert plan_tools([ADD], "none", None, tok, None).constraint is None
    gpt_oss = type("T", (), {"chat_template": "<|channel|>{{ tools }}"})()
    assert plan_tools([ADD], "required", None, gpt_oss, None).constraint is not None  # test_harmony runs it
    assert plan_tools(None, None, None, gpt_oss, None).family == "harmony"  # channels parsed without tools too


def test_a_thinking_models_constraint_starts_after_the_reasoning(tok: Tokenizer) -> None:
    thinker = char_tokenizer()
    thinker.chat_template = "{{ messages }}<think>"
    schema = Constraint.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}})
    plan = plan_tools(None, None, None, thinker, schema)
    assert plan.reasoning and plan.constraint is not None and plan.constraint != schema

    def allowed(*pieces: str) -> str:  # encoded piece by piece: this tokenizer splits no newline runs
        return allowed_after(tok, plan.constraint, pieces)

    assert allowed() == "<{"
    assert len(allowed("<think>", "any {thoughts} at all")) > 90
    assert allowed("<think>", "hm", "</think>") == "\n{"
    assert allowed("<think>", "hm", "</think>", "\n", "\n") == "\n{"
    assert allowed("<think>", "hm", "</think>", "\n", '{"a": ') == "-0123456789"
    assert allowed('{"a": 1') == ",0123456789}"  # thinking is optional
    assert allowed("<think>", "hm", "</think>", "x") == ""
    assert plan_tools(None, None, None, tok, schema).constraint == schema  # no thinking: as given
