"""OpenAI's Responses API (stateless) through the real `openai` SDK: text, streaming events,
function calls and their outputs, structured output (test_server's tiny model, served as in
test_server_agent)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

from test_server import MODEL, build_tiny, client, one_torch_thread  # noqa: E402
from test_server_agent import WEATHER, serving  # noqa: E402

from twinfer.server.serve import ServerThread  # noqa: E402

TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather forecast", "parameters": WEATHER}]


@pytest.fixture(scope="module")
def srv() -> Iterator[ServerThread]:
    with one_torch_thread(), serving(build_tiny()) as st:
        yield st


def test_text_response_equals_chat(srv: ServerThread) -> None:
    c = client(srv)
    r = c.responses.create(model=MODEL, input="hello there", instructions="be brief", max_output_tokens=12,
                           temperature=0)
    chat = c.chat.completions.create(model=MODEL, max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}])
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == chat.choices[0].message.content
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens


def test_stream_events(srv: ServerThread) -> None:
    c = client(srv)
    whole = c.responses.create(model=MODEL, input="stream me", max_output_tokens=10, temperature=0)
    events = list(c.responses.create(model=MODEL, input="stream me", max_output_tokens=10, temperature=0,
                                     stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text and events[-1].response.output_text == text


def test_function_calls_forced_streamed_and_round_tripped(srv: ServerThread) -> None:
    c = client(srv)
    r = c.responses.create(model=MODEL, input="Weather in Oslo?", tools=TOOLS, tool_choice="required",
                           parallel_tool_calls=False, max_output_tokens=300, temperature=1.0)
    calls = [item for item in r.output if item.type == "function_call"]
    assert [call.name for call in calls] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    events = list(c.responses.create(model=MODEL, input="Weather in Oslo?", tools=TOOLS, max_output_tokens=300,
                                     tool_choice={"type": "function", "name": "get_weather"},
                                     parallel_tool_calls=False, stream=True))
    done = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1
    jsonschema.validate(json.loads(done[0]), WEATHER)
    follow = c.responses.create(model=MODEL, max_output_tokens=4, tools=TOOLS, input=[
        {"role": "user", "content": "Weather in Oslo?"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "rain"}])
    assert follow.usage.input_tokens > r.usage.input_tokens


def test_structured_output_and_refusals(srv: ServerThread) -> None:
    c = client(srv)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                                "maximum": 9}},
              "required": ["ok", "n"], "additionalProperties": False}
    r = c.responses.create(model=MODEL, input="json please", max_output_tokens=60, text={
        "format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(r.output_text), schema)
    with pytest.raises(openai.BadRequestError):
        c.responses.create(model=MODEL, input="x", previous_response_id="resp_123")
    with pytest.raises(openai.BadRequestError):
        c.responses.create(model=MODEL, input="x", tools=[{"type": "web_search"}])
