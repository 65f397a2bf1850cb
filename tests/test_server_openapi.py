"""Every chat and legacy-completions body and stream chunk the server sends, checked against OpenAI's
published schemas (vendored from openai/openai-openapi under its MIT licence: tests/data/).

One deliberate departure: OpenAI's schema gives legacy completions' stream chunks the shape of the
whole response, with a required string finish_reason; mid-stream there is no reason yet, so those
chunks omit it (never a null) and are checked with it optional. twinfer's own finish reasons
("loop", "abort") are not in OpenAI's enums; these requests do not produce them.
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

from test_server import build_tiny, one_torch_thread  # noqa: E402
from test_server_agent import ASK, TOOLS, serving  # noqa: E402

from twinfer.server.serve import ServerThread  # noqa: E402

SPEC = json.loads((Path(__file__).parent / "data" / "openai_completions_schemas.json").read_text())


def openapi_nullable(x: Any) -> Any:
    """OpenAPI 3.0's `nullable: true` (still used in places) as JSON Schema: the value or null."""
    if isinstance(x, list):
        return [openapi_nullable(v) for v in x]
    if not isinstance(x, dict):
        return x
    x = {k: openapi_nullable(v) for k, v in x.items()}
    if x.pop("nullable", False):
        return {"anyOf": [x, {"type": "null"}]}
    return x


def validator(name: str, relax: bool = False) -> Any:
    root = openapi_nullable(copy.deepcopy({"components": SPEC["components"]}))
    if relax:
        item = root["components"]["schemas"][name]["properties"]["choices"]["items"]
        item["required"] = [r for r in item["required"] if r != "finish_reason"]
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", "$ref": f"#/components/schemas/{name}",
              **root}
    return jsonschema.Draft202012Validator(schema)


CHAT, CHUNK, TEXT = (validator(n) for n in ("CreateChatCompletionResponse", "CreateChatCompletionStreamResponse",
                                            "CreateCompletionResponse"))
TEXT_MID = validator("CreateCompletionResponse", relax=True)


@pytest.fixture(scope="module")
def srv() -> Iterator[ServerThread]:
    with one_torch_thread(), serving(build_tiny()) as st:
        yield st


def post(st: ServerThread, path: str, body: dict[str, Any]) -> Any:
    r = httpx.post(st.url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    if not body.get("stream"):
        return r.json()
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


CHAT_BODIES = [
    {"messages": ASK, "max_tokens": 8, "logprobs": True, "top_logprobs": 2},
    {"messages": ASK, "max_tokens": 300, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False},
    {"messages": ASK, "max_tokens": 8, "n": 2, "response_format": {"type": "json_object"}},
]


@pytest.mark.parametrize("body", CHAT_BODIES, ids=["logprobs", "tool-call", "n2-json"])
def test_chat_bodies_and_chunks_match_the_schema(srv: ServerThread, body: dict[str, Any]) -> None:
    CHAT.validate(post(srv, "/v1/chat/completions", body))
    chunks = post(srv, "/v1/chat/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    for chunk in chunks:
        CHUNK.validate(chunk)
    assert chunks[-1]["usage"]["completion_tokens"] > 0


def test_completion_bodies_and_chunks_match_the_schema(srv: ServerThread) -> None:
    body = {"prompt": "The schema", "max_tokens": 6, "logprobs": 2, "n": 2}
    TEXT.validate(post(srv, "/v1/completions", body))
    chunks = post(srv, "/v1/completions", {**body, "stream": True})
    finals = [c for c in chunks if c["choices"] and "finish_reason" in c["choices"][0]]
    assert len(finals) == 2
    for chunk in chunks:
        (TEXT if chunk in finals else TEXT_MID).validate(chunk)
