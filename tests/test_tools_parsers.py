"""Tool-call and reasoning parsers on recorded model outputs, fed whole and split at every point.

Each family's parser must give the same content and calls however the text is cut into stream
deltas (tags straddling deltas included), and a malformed call must come back as content with a
failure counted, never an exception.
"""

from __future__ import annotations

import json

import pytest

from twinfer.server.tools.events import Delta
from twinfer.server.tools.parsers import parser_for
from twinfer.server.tools.reasoning import ReasoningParser

NAMES = {"get_weather", "search"}

HERMES = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
          '</tool_call>\n<tool_call>\n{"name": "search", "arguments": {"q": "a < b"}}\n</tool_call>')
LLAMA3 = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
LLAMA3_TAG = '<|python_tag|>{"name": "search", "parameters": {"q": "x"}}; {"name": "get_weather", "parameters": {}}'
MISTRAL = '[TOOL_CALLS] [{"name": "search", "arguments": {"q": "mistral"}}, {"name": "get_weather", "arguments": {"city": "Rome"}}]'
GENERIC = ' {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Lima"}}]}'


def run(parser, chunks: list[str]) -> Delta:
    out = Delta()
    for c in chunks:
        out.extend(parser.feed(c))
    return out.extend(parser.finish())


def splits(text: str) -> list[list[str]]:
    """The text whole, one character at a time, and cut in two at every point."""
    return [[text], list(text)] + [[text[:i], text[i:]] for i in range(1, len(text))]


def calls(d: Delta) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in d.calls]


CASES = [
    ("hermes", HERMES, "Let me check.\n\n", [("get_weather", {"city": "Paris", "unit": "c"}), ("search", {"q": "a < b"})]),
    ("llama3", LLAMA3, "", [("get_weather", {"city": "Oslo"})]),
    ("llama3", LLAMA3_TAG, "", [("search", {"q": "x"}), ("get_weather", {})]),
    ("mistral", MISTRAL, "", [("search", {"q": "mistral"}), ("get_weather", {"city": "Rome"})]),
    ("generic", GENERIC, "", [("get_weather", {"city": "Lima"})]),
    ("mistral", MISTRAL.removeprefix("[TOOL_CALLS] "), "", [("search", {"q": "mistral"}),  # tag skipped
                                                             ("get_weather", {"city": "Rome"})]),
]


@pytest.mark.parametrize("family,text,content,expected", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_recorded_calls_parse_however_split(family: str, text: str, content: str, expected: list) -> None:
    for chunks in splits(text):
        d = run(parser_for(family, NAMES), chunks)
        assert calls(d) == expected, chunks
        assert d.content == content and d.failures == 0, chunks
        assert len({c.id for c in d.calls}) == len(d.calls)


def test_hermes_streams_text_before_the_tag_and_holds_a_partial_tag() -> None:
    p = parser_for("hermes", NAMES)
    assert p.feed("Sure, one moment <tool").content == "Sure, one moment "
    assert p.feed("_ca").content == ""
    d = p.feed('ll>{"name": "search", "arguments": {}}</tool_call> done')
    assert calls(d) == [("search", {})] and d.content == " done"
    assert p.feed(" <to").content == " "
    assert p.finish().content == "<to"  # never a tag: it was text all along


MALFORMED = [
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>after'),
    ("hermes", '<tool_call>{"name": "unknown_fn", "arguments": {}}</tool_call>'),
    ("hermes", '<tool_call>{"name": "search", "arguments": {"q": "cut off'),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Oslo"'),
    ("mistral", '[TOOL_CALLS] [{"name": "search", "arguments": 5}]'),
    ("generic", '{"tool_calls": "not a list"}'),
    ("generic", '{"tool_calls": [{"name": "search"'),
]


@pytest.mark.parametrize("family,text", MALFORMED, ids=[f"{m[0]}-{i}" for i, m in enumerate(MALFORMED)])
def test_malformed_calls_come_back_as_content_and_are_counted(family: str, text: str) -> None:
    for chunks in ([text], list(text)):
        d = run(parser_for(family, NAMES), chunks)
        assert d.calls == [] and d.failures == 1
        assert d.content == text


def test_plain_replies_stream_at_once() -> None:
    for family in ("llama3", "generic", "mistral"):
        p = parser_for(family, NAMES)
        assert p.feed("Hello").content == "Hello"
        assert p.feed(" {there}").content == " {there}"
        assert p.finish() == Delta()


def test_reasoning_split_from_content_and_calls() -> None:
    text = '<think>The user wants\nweather.</think>\n\n<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
    for chunks in splits(text):
        d = run(ReasoningParser(parser_for("hermes", NAMES)), chunks)
        assert d.reasoning == "The user wants\nweather." and calls(d) == [("get_weather", {})], chunks
        assert d.content == ""
    d = run(ReasoningParser(parser_for("hermes", NAMES), started=True), ["still thinking", "</think>Answer."])
    assert (d.reasoning, d.content) == ("still thinking", "Answer.")
    d = run(ReasoningParser(parser_for("generic", NAMES)), ["No thinking here."])
    assert (d.reasoning, d.content) == ("", "No thinking here.")
    d = run(ReasoningParser(parser_for("generic", NAMES)), ["<think>cut off mid-thought"])
    assert (d.reasoning, d.content) == ("cut off mid-thought", "")


HARMONY = ("<|channel|>analysis<|message|>User wants weather. Call the tool.<|end|><|start|>assistant"
           "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}")
HARMONY_FINAL = ("<|channel|>analysis<|message|>Easy: 2 + 2.<|end|><|start|>assistant<|channel|>final"
                 "<|message|>It is 4.")


def test_harmony_channels_and_calls_however_split() -> None:
    for chunks in splits(HARMONY):  # <|call|> ends generation: the engine drops it
        d = run(parser_for("harmony", NAMES), chunks)
        assert d.reasoning == "User wants weather. Call the tool." and calls(d) == [("get_weather", {"city": "Paris"})]
        assert d.content == "" and d.failures == 0, chunks
    for chunks in splits(HARMONY_FINAL):
        d = run(parser_for("harmony", NAMES), chunks)
        assert (d.reasoning, d.content, d.calls) == ("Easy: 2 + 2.", "It is 4.", []), chunks
    p = parser_for("harmony", NAMES)
    assert p.feed("<|channel|>final<|message|>Hel").content == "Hel"  # content streams as it comes
    assert p.feed("lo<|en").content == "lo" and p.feed("d|>").content == ""
    bad = run(parser_for("harmony", NAMES), ["<|channel|>commentary to=functions.nope<|message|>{}"])
    assert bad.calls == [] and bad.failures == 1


def test_follower_feeds_harmony_the_text_with_control_tokens() -> None:
    from test_constraints import char_tokenizer

    from twinfer.runtime.engine.request import RequestOutput
    from twinfer.server.metrics import ServerMetrics
    from twinfer.server.responses import Follower

    tok = char_tokenizer()
    ids = tok.encode(HARMONY_FINAL, add_special_tokens=False) + [tok.bos_id]  # a control token the text skips
    f = Follower("r", "m", True, tok, ServerMetrics(lambda: None), 0.0, parser=parser_for("harmony", NAMES))
    f.feed(RequestOutput("r", "ignored", ids[:20]))
    f.feed(RequestOutput("r", "ignored", ids[20:], finished=True, finish_reason="stop"))
    message = f.choice(False)["message"]
    assert (message["reasoning_content"], message["content"]) == ("Easy: 2 + 2.", "It is 4.<s>")


def joined_parts(d: Delta) -> dict[int, tuple[str | None, str | None, str]]:
    """index -> (id, name, the argument fragments joined), from a run's streamed parts."""
    out: dict[int, tuple[str | None, str | None, str]] = {}
    for p in d.parts:
        call_id, name, args = out.get(p.index, (None, None, ""))
        if p.id is not None:
            assert call_id is None and p.arguments == "", "id and name come once, before the arguments"
            call_id, name = p.id, p.name
        out[p.index] = (call_id, name, args + p.arguments)
    return out


STREAMED = [(family, text) for family, text, _, _ in CASES] + [("harmony", HARMONY)]


@pytest.mark.parametrize("family,text", STREAMED, ids=[f"{s[0]}-{i}" for i, s in enumerate(STREAMED)])
def test_argument_fragments_join_to_the_final_arguments(family: str, text: str) -> None:
    for chunks in [list(text)] + splits(text)[2:]:
        d = run(parser_for(family, NAMES), chunks)
        streamed = joined_parts(d)
        assert [c.index for c in d.calls] == list(range(len(d.calls))), chunks
        for c in d.calls:
            if c.index in streamed:  # a call that arrived whole in one delta is sent whole
                assert streamed[c.index] == (c.id, c.name, c.arguments), chunks
    one_by_one = run(parser_for(family, NAMES), list(text))
    fragments = [p for p in one_by_one.parts if p.arguments]
    assert len(joined_parts(one_by_one)) == len(one_by_one.calls) and len(fragments) > len(one_by_one.calls)


PARIS = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
RUNAWAY = {  # a forced reply whose model writes the same call again and again (cut mid-repetition)
    "generic": '{"tool_calls": [' + PARIS + ", " + PARIS + ", " + PARIS[:30],
    "hermes": f"<tool_call>\n{PARIS}\n</tool_call>\n<tool_call>\n{PARIS}\n</tool_call>\n<tool_call>\n{PARIS[:20]}",
}


@pytest.mark.parametrize("family", sorted(RUNAWAY))
def test_a_repeated_call_ends_the_calls_and_is_never_streamed(family: str) -> None:
    for chunks in [list(RUNAWAY[family]), [RUNAWAY[family]]]:
        parser = parser_for(family, NAMES)
        d = Delta()
        for c in chunks:
            d.extend(parser.feed(c))
            if parser.done:
                break
        assert parser.done, chunks
        d.extend(parser.finish())
        assert calls(d) == [("get_weather", {"city": "Paris"})] and d.failures == 0 and d.content.strip() == ""
        assert {p.index for p in d.parts} <= {d.calls[0].index}  # the repetition sent nothing


def test_a_second_call_is_held_while_it_could_repeat_the_first_then_streams() -> None:
    text = '{"tool_calls": [' + PARIS + ', {"name": "get_weather", "arguments": {"city": "Pau"}}]}'
    parser = parser_for("generic", NAMES)
    second_at = len('{"tool_calls": [' + PARIS + ', {"name": "get_weather", "arguments": {"city": "Pa')
    d = Delta()
    for i, ch in enumerate(text):
        step = parser.feed(ch)
        if i < second_at:  # "Pa" could still be "Paris": nothing of the second call is out
            assert all(p.index == 0 for p in step.parts)
        d.extend(step)
    d.extend(parser.finish())
    assert calls(d) == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Pau"})]
    assert joined_parts(d)[1] == (d.calls[1].id, "get_weather", '{"city": "Pau"}') and not parser.done


@pytest.mark.parametrize("family,text", [
    ("generic", '{"tool_calls": [' + PARIS + ', {"name": "search", "arguments": {"q": "rai'),
    ("mistral", "[TOOL_CALLS] [" + PARIS + ', {"name": "search", "arguments": {"q"'),
])
def test_a_list_cut_by_max_tokens_keeps_its_complete_calls(family: str, text: str) -> None:
    d = run(parser_for(family, NAMES), list(text))
    assert calls(d) == [("get_weather", {"city": "Paris"})] and d.content == "" and d.failures == 0
