"""Anthropic's Messages API through the real `anthropic` SDK: create, stream, tools, tool results,
stop sequences, count_tokens, auth by x-api-key and error statuses (test_server's tiny model, served
as in test_server_agent)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

torch = pytest.importorskip("torch")
anthropic = pytest.importorskip("anthropic")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

from test_server import MODEL, Tiny, build_tiny, one_torch_thread  # noqa: E402
from test_server_agent import WEATHER, serving  # noqa: E402

from twinfer.server.serve import ServerThread  # noqa: E402

TOOLS = [{"name": "get_weather", "description": "Weather forecast", "input_schema": WEATHER}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tiny() -> Iterator[Tiny]:
    with one_torch_thread():
        yield build_tiny()


@pytest.fixture(scope="module")
def srv(tiny: Tiny) -> Iterator[ServerThread]:
    with serving(tiny) as st:
        yield st


def client(st: ServerThread, key: str = "none") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=st.url, api_key=key, max_retries=0, timeout=60)


def test_create_matches_openai_chat_and_reports_usage(srv: ServerThread) -> None:
    m = client(srv).messages.create(model=MODEL, max_tokens=12, messages=ASK, system="be brief", extra_body={"temperature": 0})
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"]
    assert m.stop_reason in ("end_turn", "max_tokens") and m.usage.output_tokens >= 1
    chat = httpx.post(srv.url + "/v1/chat/completions", json={
        "messages": [{"role": "system", "content": "be brief"}, *ASK], "max_tokens": 12, "temperature": 0}).json()
    assert m.content[0].text == chat["choices"][0]["message"]["content"]
    assert m.usage.input_tokens == chat["usage"]["prompt_tokens"]
    count = client(srv).messages.count_tokens(model=MODEL, messages=ASK, system="be brief")
    assert count.input_tokens == m.usage.input_tokens


def test_stream_event_sequence_equals_create(srv: ServerThread) -> None:
    c = client(srv)
    whole = c.messages.create(model=MODEL, max_tokens=16, messages=ASK, extra_body={"temperature": 0})
    with c.messages.stream(model=MODEL, max_tokens=16, messages=ASK, extra_body={"temperature": 0}) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds[1] == "content_block_start" and "content_block_stop" in kinds and "message_delta" in kinds
    assert final.content[0].text == whole.content[0].text and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_stop_sequence_is_reported(srv: ServerThread) -> None:
    c = client(srv)
    text = c.messages.create(model=MODEL, max_tokens=24, messages=ASK, extra_body={"temperature": 0}).content[0].text
    stop = next(text[i:i + 2] for i in range(2, len(text) - 2) if text[i:i + 2].strip() == text[i:i + 2])
    m = c.messages.create(model=MODEL, max_tokens=24, messages=ASK, extra_body={"temperature": 0}, stop_sequences=[stop])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == text[: text.index(stop)]


def test_forced_tool_use_streamed_and_not(srv: ServerThread) -> None:
    c = client(srv)
    m = c.messages.create(model=MODEL, max_tokens=300, messages=ASK, tools=TOOLS,
                          tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}, extra_body={"temperature": 1.0})
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and [u.name for u in uses] == ["get_weather"]
    jsonschema.validate(uses[0].input, WEATHER)
    with c.messages.stream(model=MODEL, max_tokens=300, messages=ASK, tools=TOOLS,
                           tool_choice={"type": "any", "disable_parallel_tool_use": True}) as stream:
        final = stream.get_final_message()
    use = next(b for b in final.content if b.type == "tool_use")
    assert final.stop_reason == "tool_use" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER)
    # the result goes back as a tool_result block and the conversation continues
    history = [*ASK, {"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": use.name,
                                                         "input": use.input}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]}]
    after = c.messages.create(model=MODEL, max_tokens=4, messages=history, tools=TOOLS)
    assert after.usage.input_tokens > m.usage.input_tokens


def test_auth_and_errors(tiny: Tiny, srv: ServerThread) -> None:
    with pytest.raises(anthropic.BadRequestError):
        client(srv).messages.create(model=MODEL, max_tokens=4, messages=ASK, tools=TOOLS,
                                    tool_choice={"type": "tool", "name": "nope"})
    with pytest.raises(anthropic.BadRequestError):
        client(srv).messages.create(model=MODEL, max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "image", "source": {}}]}])
    with pytest.raises(anthropic.NotFoundError):
        client(srv).messages.create(model="claude-9", max_tokens=4, messages=ASK)
    r = httpx.post(srv.url + "/v1/messages", json={"messages": ASK})  # no max_tokens
    assert r.status_code == 400 and json.loads(r.text)["error"]["param"] == "max_tokens"
    from test_server import serving as plain_serving

    with plain_serving(tiny, api_key="k3y") as st:
        with pytest.raises(anthropic.AuthenticationError):
            client(st, "wrong").messages.create(model=MODEL, max_tokens=2, messages=ASK)
        assert client(st, "k3y").messages.create(model=MODEL, max_tokens=2, messages=ASK).usage.output_tokens >= 1


def test_structured_output_through_output_config(srv: ServerThread) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    m = client(srv).messages.create(model=MODEL, max_tokens=40, messages=ASK, output_config={
        "format": {"type": "json_schema", "schema": schema}})
    jsonschema.validate(json.loads(m.content[0].text), schema)
    assert m.stop_reason == "end_turn"
