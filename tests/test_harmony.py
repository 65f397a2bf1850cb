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

import pytest

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from test_constraints import NO_GUARD, HashRunner  # noqa: E402
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers  # noqa: E402
from tokenizers import Tokenizer as HFTokenizer  # noqa: E402

from twinfer.runtime.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from twinfer.runtime.errors import RequestError  # noqa: E402
from twinfer.runtime.tokenizer import Tokenizer  # noqa: E402
from twinfer.runtime.tools.plan import plan_tools  # noqa: E402

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
