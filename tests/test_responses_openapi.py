"""/v1/responses against OpenAI's published schemas (vendored from openai/openai-openapi under its MIT
licence: tests/data/openai_responses_schemas.json): the requests sent here are valid `CreateResponse`
bodies, every response is a valid `Response`, and every streamed event a valid `ResponseStreamEvent`
whose `type` matches its SSE event name. Text, reasoning-free function calls (forced and streamed,
argument deltas included), a function-call round trip and structured output, on test_server's tiny model.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

torch = pytest.importorskip("torch")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

from test_server import MODEL, build_tiny, one_torch_thread  # noqa: E402
from test_server_agent import WEATHER, serving  # noqa: E402
from test_server_openapi import openapi_nullable  # noqa: E402

from twinfer.server.serve import ServerThread  # noqa: E402

SPEC = json.loads((Path(__file__).parent / "data" / "openai_responses_schemas.json").read_text())
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather forecast", "parameters": WEATHER,
          "strict": True}]


def validator(name: str) -> Any:
    root = openapi_nullable(copy.deepcopy({"components": SPEC["components"]}))
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", "$ref": f"#/components/schemas/{name}",
              **root}
    return jsonschema.Draft202012Validator(schema)


REQUEST, RESPONSE, EVENT = (validator(n) for n in ("CreateResponse", "Response", "ResponseStreamEvent"))


@pytest.fixture(scope="module")
def srv() -> Iterator[ServerThread]:
    with one_torch_thread(), serving(build_tiny()) as st:
        yield st


def call(st: ServerThread, body: dict[str, Any]) -> Any:
    """POST a schema-checked request; the JSON response, or the stream as [(event name, data)]."""
    REQUEST.validate(body)
    r = httpx.post(st.url + "/v1/responses", json=body, timeout=120)
    assert r.status_code == 200, r.text
    if not body.get("stream"):
        return r.json()
    events, name = [], None
    for line in r.text.splitlines():
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: {"):
            events.append((name, json.loads(line[6:])))
    return events


BODIES = {
    "text": {"model": MODEL, "input": "hello there", "instructions": "be brief", "max_output_tokens": 16,
             "temperature": 0},
    "forced-call": {"model": MODEL, "input": "Weather in Oslo?", "tools": TOOLS, "tool_choice": "required",
                    "parallel_tool_calls": False, "max_output_tokens": 300},
    "named-call": {"model": MODEL, "input": [{"role": "user", "content": "Weather in Oslo?"}], "tools": TOOLS,
                   "tool_choice": {"type": "function", "name": "get_weather"}, "max_output_tokens": 300,
                   "parallel_tool_calls": False},
    "json": {"model": MODEL, "input": "json please", "max_output_tokens": 60, "text": {"format": {
        "type": "json_schema", "name": "answer", "strict": True, "schema": {
            "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
            "additionalProperties": False}}}},
}


@pytest.mark.parametrize("name", list(BODIES))
def test_responses_and_events_match_the_schema(srv: ServerThread, name: str) -> None:
    body = BODIES[name]
    whole = call(srv, body)
    RESPONSE.validate(whole)
    events = call(srv, {**body, "stream": True})
    for event_name, data in events:
        EVENT.validate(data)
        assert data["type"] == event_name
    types = [d["type"] for _, d in events]
    assert types[0] == "response.created" and types[-1] in ("response.completed", "response.incomplete")
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    RESPONSE.validate(events[-1][1]["response"])
    if "call" in name:
        deltas = "".join(d["delta"] for _, d in events if d["type"] == "response.function_call_arguments.delta")
        done = [d["arguments"] for _, d in events if d["type"] == "response.function_call_arguments.done"]
        assert done == [deltas] and json.loads(deltas).keys() == WEATHER["properties"].keys()


def test_a_function_call_round_trip_request_matches_the_schema(srv: ServerThread) -> None:
    first = call(srv, BODIES["forced-call"])
    fc = next(item for item in first["output"] if item["type"] == "function_call")
    follow = {"model": MODEL, "max_output_tokens": 16, "tools": TOOLS, "input": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"type": "function_call", "call_id": fc["call_id"], "name": "get_weather", "arguments": fc["arguments"]},
        {"type": "function_call_output", "call_id": fc["call_id"], "output": "rain"}]}
    RESPONSE.validate(call(srv, follow))
