"""What agents send, through `twinfer serve` and the real `openai` client: structured output, tools,
n > 1, logit_bias, echo, /tokenize, and the metrics that count them.

The model is test_server's tiny random llama with its one-character tokenizer and a ChatML template
that knows no tools, so tool calls take the generic form; random weights make every guarantee here
the grammar's, not the model's.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Literal

import httpx
import pytest

torch = pytest.importorskip("torch")
openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

from test_server import MODEL, NO_GUARD, Tiny, build_tiny, client, metric, one_torch_thread  # noqa: E402

from twinfer.backends.cuda.runner import build_torch_runner  # noqa: E402
from twinfer.runtime.engine import Engine, EngineConfig  # noqa: E402
from twinfer.runtime.engine.async_engine import AsyncEngine  # noqa: E402
from twinfer.server import create_app  # noqa: E402
from twinfer.server.serve import ServerThread  # noqa: E402

CTX = 2048  # the generic tool prompt is ~900 one-character tokens

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 10},
    "unit": {"enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                              "b": {"type": "integer", "minimum": 0, "maximum": 99}},
             "required": ["a", "b"], "additionalProperties": False}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)
    age: int = pydantic.Field(ge=0, le=120)
    role: Literal["admin", "user"]


@pytest.fixture(scope="module")
def tiny() -> Iterator[Tiny]:
    with one_torch_thread():
        yield build_tiny()


@contextlib.contextmanager
def serving(tiny: Tiny) -> Iterator[ServerThread]:
    runner = build_torch_runner(tiny.spec, tiny.weights, kv_tokens=4 * CTX, block_size=16)
    engine = AsyncEngine(Engine(runner, tiny.tokenizer, EngineConfig(max_seqs=8, max_context=CTX)))
    engine.start()
    st = ServerThread(create_app(engine, tiny.tokenizer, MODEL, guard=NO_GUARD)).start()
    st.engine = engine  # type: ignore[attr-defined]
    try:
        yield st
    finally:
        st.call(engine.shutdown(drain=False), timeout_s=10)
        st.stop()


@pytest.fixture(scope="module")
def srv(tiny: Tiny) -> Iterator[ServerThread]:
    with serving(tiny) as st:
        yield st


def test_parse_with_a_pydantic_model(srv: ServerThread) -> None:
    c = client(srv)
    for seed in range(3):
        r = c.chat.completions.parse(model=MODEL, messages=ASK, response_format=Person, max_tokens=200,
                                     temperature=1.0, seed=seed)
        assert r.choices[0].finish_reason == "stop"
        person = r.choices[0].message.parsed
        assert isinstance(person, Person) and person.role in ("admin", "user")
    assert metric(srv, "twinfer_constrained_requests_total") >= 3
    assert metric(srv, "twinfer_mask_seconds_per_step") > 0


def test_json_object_and_vendor_constraint_spellings(srv: ServerThread) -> None:
    c = client(srv)
    r = c.chat.completions.create(model=MODEL, messages=ASK, response_format={"type": "json_object"},
                                  max_tokens=40, temperature=0.7, seed=1)
    assert r.choices[0].message.content.startswith('{"')  # random weights ramble in a key: the real-model test parses
    cases = [({"guided_choice": ["red", "green"]}, lambda t: t in ("red", "green")),
             ({"structured_outputs": {"regex": "[0-9]{4}"}}, lambda t: len(t) == 4 and t.isdigit()),
             ({"guided_regex": "(ab)+c"}, lambda t: t.startswith("ab") and t.endswith("c")),
             ({"json_schema": {"type": "integer", "minimum": 10, "maximum": 20}}, lambda t: 10 <= int(t) <= 20),
             ({"grammar": 'root ::= "yes" | "no"'}, lambda t: t in ("yes", "no")),
             ({"guided_json": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
              lambda t: isinstance(json.loads(t), list))]
    for extra, check in cases:
        text = c.completions.create(model=MODEL, prompt="answer:", max_tokens=60, temperature=1.0, seed=2,
                                    extra_body=extra).choices[0].text
        assert check(text), (extra, text)


def _args_ok(name: str, arguments: str) -> None:
    schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)
    jsonschema.validate(json.loads(arguments), schema)


def test_tool_choice_required_and_named(srv: ServerThread) -> None:
    c = client(srv)
    for seed in range(3):
        r = c.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                      max_tokens=300, temperature=1.0, seed=seed, parallel_tool_calls=seed == 0)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        for call in choice.message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            _args_ok(call.function.name, call.function.arguments)
    r = c.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=200, parallel_tool_calls=False,
                                  tool_choice={"type": "function", "function": {"name": "add"}})
    calls = r.choices[0].message.tool_calls
    assert [call.function.name for call in calls] == ["add"]
    _args_ok("add", calls[0].function.arguments)


def test_streamed_tool_call_deltas(srv: ServerThread) -> None:
    chunks = list(client(srv).chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=200, stream=True, parallel_tool_calls=False,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    deltas = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    # index, id and name first, then the arguments fragment by fragment as they are generated
    assert len(deltas) > 3 and {d.index for d in deltas} == {0}
    assert deltas[0].id and deltas[0].function.name == "get_weather" and deltas[0].function.arguments == ""
    assert all(d.id is None and d.function.name is None and d.function.arguments for d in deltas[1:])
    arguments = "".join(d.function.arguments or "" for d in deltas)
    _args_ok("get_weather", arguments)
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == ["tool_calls"]
    assert not "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)


def test_argument_deltas_through_the_sdk_stream_helper(srv: ServerThread) -> None:
    fragments: list[str] = []
    done: list[str] = []
    with client(srv).chat.completions.stream(
            model=MODEL, messages=ASK, tools=[{**TOOLS[0], "function": {**TOOLS[0]["function"], "strict": True}}],
            max_tokens=200, parallel_tool_calls=False, tool_choice="required") as stream:
        for event in stream:
            if event.type == "tool_calls.function.arguments.delta":
                fragments.append(event.arguments_delta)
            elif event.type == "tool_calls.function.arguments.done":
                done.append(event.arguments)
        final = stream.get_final_completion()
    call = final.choices[0].message.tool_calls[0]
    assert len(fragments) > 3 and done == ["".join(fragments)] == [call.function.arguments]
    _args_ok("get_weather", call.function.arguments)
    assert call.function.parsed_arguments == json.loads(call.function.arguments)  # the helper's own parse


def test_malformed_call_comes_back_as_content_and_is_counted(srv: ServerThread) -> None:
    before = metric(srv, "twinfer_tool_call_parse_failures_total")
    bad = '{"tool_calls": [{"name": "no_such_tool", "arguments": {}}]}'
    regex = bad.replace("[", r"\[").replace("]", r"\]").replace("{", r"\{").replace("}", r"\}")
    r = client(srv).chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=120,
                                            extra_body={"guided_regex": regex})
    assert r.choices[0].message.content == bad and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"
    assert metric(srv, "twinfer_tool_call_parse_failures_total") == before + 1


def test_tool_turns_round_trip_through_the_generic_form(srv: ServerThread, tiny: Tiny) -> None:
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    r = httpx.post(srv.url + "/tokenize", json={"messages": history})
    assert r.status_code == 200, r.text
    r = client(srv).chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=4)
    assert r.usage.prompt_tokens > len(tiny.tokenizer.encode("sunny, 21 C"))


def test_n_choices_share_the_prompt_blocks(srv: ServerThread, tiny: Tiny) -> None:
    prompt = "A long shared prompt that fills several KV blocks of sixteen tokens each. " * 2
    n_prompt = len(tiny.tokenizer.encode(prompt))
    before = metric(srv, "twinfer_prompt_cached_tokens_total")
    r = client(srv).completions.create(model=MODEL, prompt=prompt, n=3, max_tokens=12, temperature=1.0, seed=4,
                                       extra_body={"ignore_eos": True})
    assert [ch.index for ch in r.choices] == [0, 1, 2] and len({ch.text for ch in r.choices}) > 1
    assert r.usage.completion_tokens == 36 and r.usage.prompt_tokens == n_prompt
    shared = metric(srv, "twinfer_prompt_cached_tokens_total") - before
    assert shared == 2 * 16 * (n_prompt // 16)  # choices 1 and 2 reused every full block of choice 0's prompt
    chunks = list(client(srv).chat.completions.create(model=MODEL, messages=ASK, n=2, max_tokens=5, stream=True,
                                                      temperature=0))
    texts = ["".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices and ch.choices[0].index == i)
             for i in (0, 1)]
    assert texts[0] == texts[1] and texts[0]  # greedy: the same text twice


def test_logit_bias_echo_and_tokenize(srv: ServerThread, tiny: Tiny) -> None:
    c = client(srv)
    first = c.completions.create(model=MODEL, prompt="bias me", max_tokens=1, temperature=0,
                                 extra_body={"ignore_eos": True}).choices[0].text
    banned = tiny.tokenizer.encode(first, add_special_tokens=False)[0]
    text = c.completions.create(model=MODEL, prompt="bias me", max_tokens=6, temperature=0, logit_bias={str(banned): -100},
                                extra_body={"ignore_eos": True}).choices[0].text
    assert first not in text
    echoed = c.completions.create(model=MODEL, prompt="echo this", max_tokens=3, temperature=0, echo=True)
    assert echoed.choices[0].text.startswith("echo this")
    stream = list(c.completions.create(model=MODEL, prompt="echo this", max_tokens=3, temperature=0, echo=True,
                                       stream=True))
    assert "".join(ch.choices[0].text for ch in stream) == echoed.choices[0].text
    ids = httpx.post(srv.url + "/tokenize", json={"prompt": "hello"}).json()
    assert ids["tokens"] == tiny.tokenizer.encode("hello") and ids["count"] == 5 and ids["max_model_len"] == CTX
    back = httpx.post(srv.url + "/detokenize", json={"tokens": ids["tokens"]}).json()
    assert back == {"prompt": "hello"}
    assert httpx.post(srv.url + "/detokenize", json={"tokens": [10**6]}).status_code == 400


def test_completion_stream_chunks_carry_a_reason_only_at_the_end(srv: ServerThread) -> None:
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 4, "stream": True,
                                                      "ignore_eos": True})
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    reasons = [e["choices"][0].get("finish_reason", "absent") for e in events]
    assert reasons[-1] == "length" and set(reasons[:-1]) == {"absent"}


def test_grammar_over_the_time_limit_is_a_400(tiny: Tiny) -> None:
    with serving(tiny) as st:
        st.engine.engine.grammars.time_limit_s = 1e-6  # type: ignore[attr-defined]
        r = httpx.post(st.url + "/v1/completions", json={"prompt": "x", "max_tokens": 4,
                                                         "guided_choice": [f"choice {i}" for i in range(500)]})
        assert r.status_code == 400 and "longer than" in r.json()["error"]["message"]
        assert r.json()["error"]["code"] == "invalid_grammar"
        assert st.engine.engine.metrics.arrived == 0  # type: ignore[attr-defined]


