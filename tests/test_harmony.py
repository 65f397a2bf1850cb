"""gpt-oss's harmony format under a forced tool choice: the grammar admits an optional analysis
message, then one `commentary to=functions.NAME <|constrain|>json` message whose body matches the
function's schema, and the harmony parser reads the call back.

The tokenizer is a character vocabulary plus harmony's control tokens (openai-harmony's own o200k
encoding is fetched from the network on first use, so it is not available to tests); the model is
test_constraints' deterministic fake, whose unconstrained choices are control tokens: every call
here is the grammar's doing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from test_constraints import NO_GUARD, HashRunner  # noqa: E402
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers  # noqa: E402
from tokenizers import Tokenizer as HFTokenizer  # noqa: E402

from twinfer.runtime.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from twinfer.runtime.errors import RequestError  # noqa: E402
from twinfer.runtime.tokenizer import Tokenizer  # noqa: E402
from twinfer.runtime.tokenizer.harmony import render_harmony  # noqa: E402
from twinfer.server.tools.plan import plan_tools  # noqa: E402

CONTROL = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>",
           "<|endoftext|>"]
TEMPLATE = ("{% for m in messages %}<|start|>{{ m.role }}{% if m.role == 'assistant' %}<|channel|>final{% endif %}"
            "<|message|>{{ m.content }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|start|>assistant{% endif %}")
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
       "required": ["a"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]


def harmony_tokenizer() -> Tokenizer:
    chars = ["\n", "\t"] + [chr(i) for i in range(32, 127)]
    vocab = {c: i for i, c in enumerate(chars + CONTROL)}
    hf = HFTokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    hf.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    hf.decoder = decoders.Fuse()
    hf.add_special_tokens([AddedToken(s, special=True) for s in CONTROL])
    return Tokenizer(hf, bos_id=None, eos_ids=[vocab["<|return|>"], vocab["<|call|>"]], chat_template=TEMPLATE)


def forced(tool_choice: object, seed: int) -> tuple[str, object]:
    tok = harmony_tokenizer()
    plan = plan_tools(TOOLS, tool_choice, None, tok, None)
    assert plan.family == "harmony" and plan.constraint is not None
    prompt = tok.encode_chat([{"role": "user", "content": "Weather in Oslo?"}])
    engine = Engine(HashRunner(tok.vocab_size, seed=seed), tok, EngineConfig(max_seqs=4, max_context=2048))
    out = engine.generate([prompt], SamplingParams(max_tokens=400, temperature=0.0, guard=NO_GUARD,
                                                   constraint=plan.constraint))[0]
    assert out.finish_reason == "stop", out.text
    text = tok.decode(out.token_ids)  # with the control tokens, as the server's parser reads it
    parser = plan.parser()
    delta = parser.feed(text)
    return text, delta.extend(parser.finish())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_required_tool_choice_gives_one_valid_call(seed: int) -> None:
    text, delta = forced("required", seed)
    assert text.startswith("<|channel|>") and delta.failures == 0 and delta.content == "", text
    assert len(delta.calls) == 1, text
    call = delta.calls[0]
    jsonschema.validate(json.loads(call.arguments), WEATHER if call.name == "get_weather" else ADD)
    assert f"<|channel|>commentary to=functions.{call.name} <|constrain|>json<|message|>" in text


def test_named_tool_choice_calls_that_function() -> None:
    for seed in (0, 3):
        text, delta = forced({"type": "function", "function": {"name": "add"}}, seed)
        assert [c.name for c in delta.calls] == ["add"], text
        jsonschema.validate(json.loads(delta.calls[0].arguments), ADD)


def test_forced_choice_with_a_response_format_is_refused() -> None:
    from twinfer.runtime.constraints import Constraint

    with pytest.raises(RequestError, match="response_format"):
        plan_tools(TOOLS, "required", None, harmony_tokenizer(), Constraint.json_schema(ADD))


# -- the prompt: harmony's own golden renderings -------------------------------------------------------
GOLDEN = Path(__file__).parent / "data" / "harmony"
HARMONY_TOOLS = [
    {"name": "get_location", "description": "Gets the location of the user."},
    {"name": "get_current_weather", "description": "Gets the current weather in the provided location.",
     "parameters": {"type": "object", "properties": {
         "location": {"type": "string", "description": "The city and state, e.g. San Francisco, CA"},
         "format": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"}},
         "required": ["location"]}},
    {"name": "get_multiple_weathers", "description": "Gets the current weather in the provided list of locations.",
     "parameters": {"type": "object", "properties": {
         "locations": {"type": "array", "items": {"type": "string"},
                       "description": 'List of city and state, e.g. ["San Francisco, CA", "New York, NY"]'},
         "format": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"}},
         "required": ["locations"]}},
    {"name": "kitchensink", "description": "A function with various complex schemas.", "parameters": {
        "description": "params object", "type": "object", "properties": {
            "string": {"type": "string", "title": "STRING", "description": "A string", "examples": ["hello", "world"]},
            "string_nullable": {"type": "string", "nullable": True, "description": "A nullable string",
                                "default": "the default"},
            "string_enum": {"type": "string", "enum": ["a", "b", "c"]},
            "oneof_string_or_number": {"oneOf": [{"type": "string", "default": "default_string_in_oneof"},
                                                 {"type": "number", "description": "numbers can happen too"}],
                                       "description": "a oneof", "default": 20}}}},
]


def golden(name: str) -> str:
    return (GOLDEN / f"{name}.txt").read_text(encoding="utf-8").rstrip()


def test_prompts_match_openai_harmonys_renderings() -> None:
    ask = [{"role": "user", "content": "What is 2 + 2?"}]
    assert render_harmony(ask) == golden("test_simple_convo")
    robot = [{"role": "developer", "content": "Answer the user's questions like a robot."},
             {"role": "user", "content": "What is the capital of the largest country in the world?"}]
    assert render_harmony(robot, reasoning_effort="low") == golden("test_simple_convo_low_effort")
    tools = [{"type": "function", "function": f} for f in HARMONY_TOOLS]
    messages = [{"role": "system", "content": "Always respond in riddles"},
                {"role": "user", "content": "What is the weather like in SF?"}]
    assert render_harmony(messages, tools, reasoning_effort="high", current_date="2025-06-28") == \
        golden("test_render_functions_with_parameters")
    with pytest.raises(RequestError, match="reasoning_effort"):
        render_harmony(ask, reasoning_effort="maximal")


def test_a_tool_chain_keeps_its_reasoning_and_ends_calls_with_call() -> None:
    messages = [{"role": "user", "content": "Weather in SF?"},
                {"role": "assistant", "reasoning_content": "Use the tool.", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function",
                     "function": {"name": "lookup_weather", "arguments": '{"location": "San Francisco"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": '{"temperature": 20}'}]
    text = render_harmony(messages, [{"type": "function", "function": {"name": "lookup_weather"}}])
    assert text.endswith(
        "<|start|>user<|message|>Weather in SF?<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>Use the tool.<|end|>"
        "<|start|>assistant to=functions.lookup_weather<|channel|>commentary <|constrain|>json<|message|>"
        '{"location": "San Francisco"}<|call|>'
        '<|start|>functions.lookup_weather to=assistant<|channel|>commentary<|message|>{"temperature": 20}<|end|>'
        "<|start|>assistant")
    done = [*messages, {"role": "assistant", "reasoning_content": "Sunny.", "content": "It is 20 C."},
            {"role": "user", "content": "Thanks"}]
    text = render_harmony(done)  # a final answer closed the chain: its reasoning is dropped
    assert "Use the tool." not in text and "Sunny." not in text
    assert "<|start|>assistant<|channel|>final<|message|>It is 20 C.<|end|>" in text


# -- through the server and the openai SDK --------------------------------------------------------------
def test_gpt_oss_chat_through_the_server() -> None:
    openai = pytest.importorskip("openai")
    from twinfer.runtime.engine.async_engine import AsyncEngine
    from twinfer.server import create_app
    from twinfer.server.serve import ServerThread

    tok = harmony_tokenizer()
    engine = AsyncEngine(Engine(HashRunner(tok.vocab_size, seed=1), tok, EngineConfig(max_seqs=4, max_context=4096)))
    engine.start()
    st = ServerThread(create_app(engine, tok, "oss", guard=NO_GUARD)).start()
    try:
        client = openai.OpenAI(base_url=st.url + "/v1", api_key="none", max_retries=0, timeout=60)
        ask = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"}]
        r = client.chat.completions.create(model="oss", messages=ask, tools=TOOLS, tool_choice="required",
                                           max_tokens=300, temperature=0, reasoning_effort="high")
        assert r.choices[0].finish_reason == "tool_calls" and r.usage.prompt_tokens > 400  # the tool namespace
        call = r.choices[0].message.tool_calls[0]
        jsonschema.validate(json.loads(call.function.arguments), WEATHER if call.function.name == "get_weather" else ADD)
        with client.chat.completions.stream(model="oss", messages=ask, tools=TOOLS, max_tokens=300, temperature=0,
                                            tool_choice={"type": "function", "function": {"name": "get_weather"}}
                                            ) as stream:
            fragments = [e.arguments_delta for e in stream if e.type == "tool_calls.function.arguments.delta"]
            final = stream.get_final_completion()
        streamed = final.choices[0].message.tool_calls[0].function
        assert streamed.name == "get_weather" and "".join(fragments) == streamed.arguments and len(fragments) > 1
        jsonschema.validate(json.loads(streamed.arguments), WEATHER)
        bad = client.with_options(max_retries=0).chat.completions.with_raw_response
        with pytest.raises(openai.BadRequestError, match="reasoning_effort"):
            bad.create(model="oss", messages=ask, reasoning_effort="maximal")  # type: ignore[arg-type]
    finally:
        st.call(engine.shutdown(drain=False), timeout_s=10)
        st.stop()


@pytest.mark.slow  # minutes on a loaded 2-core box; test_gpt_oss_chat_through_the_server covers the path
def test_a_tiny_gpt_oss_model_calls_a_tool_through_the_server(tmp_path: Path) -> None:
    """A random-weight gpt-oss (transformers) saved with the harmony tokenizer and template, loaded
    and served by twinfer: the forced call parses and matches its schema."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    openai = pytest.importorskip("openai")
    from twinfer.backends.cuda.runner import build_torch_runner
    from twinfer.runtime.engine.async_engine import AsyncEngine
    from twinfer.runtime.loaders import load_model
    from twinfer.server import create_app
    from twinfer.server.serve import ServerThread

    tok = harmony_tokenizer()
    eos = sorted(tok.eos_ids)
    config = transformers.GptOssConfig(vocab_size=tok.vocab_size, hidden_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                                       sliding_window=8, max_position_embeddings=4096, eos_token_id=eos)
    torch.manual_seed(0)
    transformers.GptOssForCausalLM(config).save_pretrained(tmp_path)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.backend, eos_token="<|return|>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(tmp_path)
    served = Tokenizer.from_hf(tmp_path)
    assert served.eos_ids == set(eos)
    loaded = load_model(tmp_path)
    assert loaded.spec.model_type == "gpt_oss"
    weights = {name: loaded.weights.load(name) for name in loaded.weights.names()}
    runner = build_torch_runner(loaded.spec, weights, kv_tokens=4096, block_size=16)
    engine = AsyncEngine(Engine(runner, served, EngineConfig(max_seqs=2, max_context=2048)))
    engine.start()
    st = ServerThread(create_app(engine, served, "oss", guard=NO_GUARD)).start()
    try:
        client = openai.OpenAI(base_url=st.url + "/v1", api_key="none", max_retries=0, timeout=120)
        r = client.chat.completions.create(model="oss", messages=[{"role": "user", "content": "Add 3."}],
                                           tools=TOOLS, max_tokens=200, temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "add"}})
        calls = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and [c.function.name for c in calls] == ["add"]
        jsonschema.validate(json.loads(calls[0].function.arguments), ADD)
    finally:
        st.call(engine.shutdown(drain=False), timeout_s=10)
        st.stop()
