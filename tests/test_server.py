"""`twinfer serve` in-process: the real `openai` client and raw httpx against a real Engine.

The model is a tiny random-weight llama on the torch runner (built from numpy weights, so no
transformers import) with a one-character-per-token tokenizer, served by uvicorn on an OS-chosen loopback port.
Greedy outputs are compared with the same prompt run straight through `Engine.generate`, so the
HTTP path (chat template, stop strings, logprobs, usage) is checked against the engine, not itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
import pytest

torch = pytest.importorskip("torch")
openai = pytest.importorskip("openai")

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers  # noqa: E402
from tokenizers import Tokenizer as HFTokenizer  # noqa: E402

from twinfer.backends.cuda.runner import build_torch_runner  # noqa: E402
from twinfer.runtime.engine import Engine, EngineConfig, GuardConfig, SamplingParams  # noqa: E402
from twinfer.runtime.engine.async_engine import AsyncEngine, Overloaded, ShuttingDown  # noqa: E402
from twinfer.runtime.runner import Runner  # noqa: E402
from twinfer.runtime.spec import ModelSpec  # noqa: E402
from twinfer.runtime.tokenizer import Tokenizer  # noqa: E402
from twinfer.server import create_app  # noqa: E402
from twinfer.server.http_bench import run_http_bench  # noqa: E402
from twinfer.server.serve import ServerThread  # noqa: E402

MODEL = "tiny-llama"
CTX = 512
VOCAB = 102  # 97 characters + 5 specials
NO_GUARD = GuardConfig(enabled=False)
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]


# -- the tiny model ---------------------------------------------------------------------------------
@dataclass
class Tiny:
    spec: ModelSpec
    weights: dict[str, np.ndarray]
    tokenizer: Tokenizer

    def runner(self) -> Runner:
        return build_torch_runner(self.spec, self.weights, kv_tokens=2 * CTX, block_size=16)

    def engine(self, max_seqs: int = 8) -> Engine:
        return Engine(self.runner(), self.tokenizer, EngineConfig(max_seqs=max_seqs, max_context=CTX))


def char_tokenizer() -> Tokenizer:
    """One token per printable ASCII character (so any output decodes to clean text), ChatML specials,
    EOS = <|im_end|>, BOS = <s>."""
    chars = ["\n", "\t"] + [chr(i) for i in range(32, 127)]
    specials = ["<s>", "</s>", "<|im_start|>", "<|im_end|>", "<unk>"]
    vocab = {c: i for i, c in enumerate(chars + specials)}
    hf = HFTokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    hf.decoder = decoders.Fuse()
    hf.add_special_tokens([AddedToken(s, special=True) for s in specials])
    assert hf.get_vocab_size() == VOCAB
    return Tokenizer(hf, bos_id=vocab["<s>"], eos_ids=[vocab["<|im_end|>"]], add_bos=True)


@pytest.fixture(scope="module")
def tiny() -> Iterator[Tiny]:
    with one_torch_thread():
        yield build_tiny()


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """The tiny model's steps on one torch thread, for tests that serve it in this process.

    An OpenMP pool spinning on both cores of a small machine stalls whenever the server's event loop
    runs (50x slower steps under load)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def build_tiny() -> Tiny:
    C, H, KV, D, FF, L = 64, 4, 2, 16, 96, 2
    spec = ModelSpec(model_type="llama", vocab_size=VOCAB, hidden_size=C, num_layers=L, num_heads=H,
                     num_kv_heads=KV, head_dim=D, intermediate_size=FF, max_position=2048,
                     tie_word_embeddings=True)
    rng = np.random.default_rng(0)

    def w(*shape: int) -> np.ndarray:
        return rng.normal(0.0, shape[-1] ** -0.5, shape).astype(np.float32)

    weights = {"embed": rng.normal(0.0, 0.25, (VOCAB, C)).astype(np.float32), "norm": np.ones(C, np.float32)}
    for i in range(L):
        p = f"layers.{i}."
        weights |= {p + "attn_norm": np.ones(C, np.float32), p + "mlp_norm": np.ones(C, np.float32),
                    p + "q": w(H * D, C), p + "k": w(KV * D, C), p + "v": w(KV * D, C), p + "o": w(C, H * D),
                    p + "gate": w(FF, C), p + "up": w(FF, C), p + "down": w(C, FF)}
    return Tiny(spec, weights, char_tokenizer())


@contextlib.contextmanager
def serving(tiny: Tiny, *, max_seqs: int = 8, max_queue: int = 64, guard: GuardConfig = NO_GUARD,
            runner: Runner | None = None, grace_s: float = 30.0, **app_kw: Any) -> Iterator[ServerThread]:
    engine = Engine(runner or tiny.runner(), tiny.tokenizer, EngineConfig(max_seqs=max_seqs, max_context=CTX))
    async_engine = AsyncEngine(engine, max_queue=max_queue)
    async_engine.start()
    app = create_app(async_engine, tiny.tokenizer, MODEL, guard=guard, **app_kw)
    st = ServerThread(app, grace_s=grace_s).start()
    st.engine = async_engine  # type: ignore[attr-defined]
    try:
        yield st
    finally:
        if st._thread.is_alive():
            with contextlib.suppress(Exception):
                st.call(async_engine.shutdown(drain=False), timeout_s=10)
        st.stop()


@pytest.fixture(scope="module")
def srv(tiny: Tiny) -> Iterator[ServerThread]:
    with serving(tiny) as st:
        yield st


def client(st: ServerThread, key: str = "none") -> Any:
    return openai.OpenAI(base_url=st.url + "/v1", api_key=key, max_retries=0, timeout=60)


def reference(tiny: Tiny, prompt: list[int], **params: Any) -> Any:
    """The same request straight through a fresh Engine (the path the server must not change)."""
    return tiny.engine().generate([prompt], SamplingParams(guard=NO_GUARD, **params))[0]


def metric(st: ServerThread, name: str) -> float:
    text = httpx.get(st.url + "/metrics").text
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def sse_events(lines: list[str]) -> list[Any]:
    return [line[6:] if line[6:] == "[DONE]" else json.loads(line[6:]) for line in lines if line.startswith("data: ")]


# -- the openai client ------------------------------------------------------------------------------
def test_chat_non_streaming_matches_engine_with_template_and_logprobs(srv: ServerThread, tiny: Tiny) -> None:
    ids = tiny.tokenizer.encode_chat(CHAT)
    assert ids[0] == tiny.tokenizer.bos_id and tiny.tokenizer.decode(ids).count("<|im_start|>") == 3
    ref = reference(tiny, ids, max_tokens=12, temperature=0.0, logprobs=3)
    r = client(srv).chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0,
                                            logprobs=True, top_logprobs=3)
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == ref.text
    assert choice.finish_reason == ref.finish_reason
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(ref.token_ids)
    assert r.usage.total_tokens == len(ids) + len(ref.token_ids)
    content = choice.logprobs.content
    assert len(content) == len(ref.token_ids)
    for got, want in zip(content, ref.logprobs, strict=True):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-5)
        assert [t.logprob for t in got.top_logprobs] == pytest.approx([lp for _, lp in want.top], abs=1e-5)
        assert got.top_logprobs[0].logprob >= got.top_logprobs[-1].logprob
        assert got.token == tiny.tokenizer.decode([want.token])


def test_chat_streaming_equals_non_streaming_with_usage(srv: ServerThread, tiny: Tiny) -> None:
    ids = tiny.tokenizer.encode_chat(CHAT)
    ref = reference(tiny, ids, max_tokens=20, temperature=0.0)
    chunks = list(client(srv).chat.completions.create(
        model=MODEL, messages=CHAT, max_completion_tokens=20, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [ref.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)
    assert chunks[-1].usage.prompt_tokens == len(ids)


def test_completions_streaming_and_not_with_logprobs(srv: ServerThread, tiny: Tiny) -> None:
    prompt = "The quick brown fox"
    ids = tiny.tokenizer.encode(prompt)
    ref = reference(tiny, ids, max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2)
    c = client(srv)
    r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, logprobs=2,
                             extra_body={"ignore_eos": True})
    assert r.choices[0].text == ref.text and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 10
    lp = r.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([x.logprob for x in ref.logprobs], abs=1e-5)
    assert all(len(top) <= 2 for top in lp.top_logprobs) and len(lp.tokens) == 10
    stream = c.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0, stream=True,
                                  extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(ch.choices[0].text for ch in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_string_cuts_text(srv: ServerThread, tiny: Tiny) -> None:
    ids = tiny.tokenizer.encode("stop here")
    ref = reference(tiny, ids, max_tokens=24, temperature=0.0, ignore_eos=True)
    printable = [i for i in range(3, len(ref.text) - 2) if ref.text[i:i + 2].isprintable()]
    assert printable, f"no printable 2-character stop candidate in {ref.text!r}"
    stop = ref.text[printable[0]:printable[0] + 2]
    r = client(srv).completions.create(model=MODEL, prompt="stop here", max_tokens=24, temperature=0, stop=[stop],
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == ref.text[: ref.text.index(stop)]


def test_seed_reproducible(srv: ServerThread) -> None:
    c = client(srv)

    def sample(seed: int) -> str:
        r = c.completions.create(model=MODEL, prompt="once upon", max_tokens=16, temperature=1.0, seed=seed,
                                 extra_body={"ignore_eos": True})
        return r.choices[0].text

    first = sample(7)
    assert sample(7) == first
    assert sample(8) != first


def test_loop_guard_finish_reason(tiny: Tiny) -> None:
    """The guard cuts a looping reply ("loop"); a client that ignores EOS asks for exactly max_tokens,
    so for it the guard is off, as EOS is (benchmark traffic)."""
    guard = GuardConfig(filler_chars=16)  # the random model floods one character (filler): cut it at 16
    engine = tiny.engine()
    prompts = [f"loop {i}" for i in range(24)]
    outs = engine.generate(prompts, SamplingParams(max_tokens=64, temperature=0.0, guard=guard))
    looping = [p for p, o in zip(prompts, outs, strict=True) if o.finish_reason == "loop"]
    assert looping, "the random model never loops on these prompts; pick others"
    with serving(tiny, guard=guard) as st:
        r = client(st).completions.create(model=MODEL, prompt=looping[0], max_tokens=64, temperature=0)
        assert r.choices[0].finish_reason == "loop"
        assert metric(st, "twinfer_guard_trips_total") == 1
        assert metric(st, 'twinfer_request_finish_total{reason="loop"}') == 1
        r = client(st).completions.create(model=MODEL, prompt=looping[0], max_tokens=64, temperature=0,
                                          extra_body={"ignore_eos": True})
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 64
        assert metric(st, "twinfer_guard_trips_total") == 1


def test_models_health_metrics(srv: ServerThread) -> None:
    models = client(srv).models.list()
    assert [m.id for m in models.data] == [MODEL]
    health = httpx.get(srv.url + "/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert health.json()["max_context"] == CTX
    assert metric(srv, "twinfer_kv_blocks_total") == 2 * CTX // 16
    assert metric(srv, "twinfer_engine_up") == 1


def test_non_streamed_answers_take_one_output(tiny: Tiny) -> None:
    """A non-streamed answer with no tool parser gets its output once, finished (vLLM's FINAL_ONLY), so the
    event loop is not woken every step; a stream gets one a step. Same text; time to first token comes from
    the engine's clock, not from the one delivery."""
    with serving(tiny) as st:
        seen: list[Any] = []
        dispatch = st.engine._dispatch  # type: ignore[attr-defined]

        def spy(outputs: list[Any], streams: Any) -> Any:
            seen.extend(outputs)
            return dispatch(outputs, streams)

        st.engine._dispatch = spy  # type: ignore[attr-defined]
        ask = {"model": MODEL, "messages": CHAT, "max_tokens": 12, "temperature": 0, "extra_body": {"ignore_eos": True}}
        whole = client(st).chat.completions.create(**ask)
        delivered, seen[:] = list(seen), []
        text = "".join(c.choices[0].delta.content or "" for c in client(st).chat.completions.create(**ask, stream=True)
                       if c.choices)
        assert [o.finished for o in delivered] == [True] and len(delivered[0].token_ids) == 12
        assert len(seen) >= 12 and seen[-1].finished
        assert text == whole.choices[0].message.content
        ttft, latency = (metric(st, f"twinfer_{n}_seconds_sum") for n in ("time_to_first_token", "request_latency"))
        assert 0 < ttft < latency


# -- bad input never reaches the engine ----------------------------------------------------------------
OK_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
OK_COMP = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
CHAT_URL, COMP_URL = "/v1/chat/completions", "/v1/completions"
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
BAD = [  # (id, path, body (bytes: sent as is), status, param)
    ("malformed json", CHAT_URL, b'{"messages": [', 400, None),
    ("not an object", CHAT_URL, b"[1, 2]", 400, None),
    ("nested too deep", CHAT_URL, b"[" * 100_000 + b"]" * 100_000, 400, None),
    ("not utf-8", CHAT_URL, b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, None),
    ("form content type", CHAT_URL, (json.dumps(OK_CHAT).encode(), "application/x-www-form-urlencoded"), 400, None),
    ("empty body", CHAT_URL, b"", 400, None),
    ("no messages", CHAT_URL, {"model": MODEL}, 400, "messages"),
    ("empty messages", CHAT_URL, {**OK_CHAT, "messages": []}, 400, "messages"),
    ("messages is a string", CHAT_URL, {**OK_CHAT, "messages": "hi"}, 400, "messages"),
    ("bad role", CHAT_URL, {**OK_CHAT, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ("content is a number", CHAT_URL, {**OK_CHAT, "messages": [{"role": "user", "content": 5}]}, 400, None),
    ("image part", CHAT_URL, {**OK_CHAT, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400, "messages[0].content[0]"),
    ("temperature string", CHAT_URL, {**OK_CHAT, "temperature": "hot"}, 400, "temperature"),
    ("temperature 3", CHAT_URL, {**OK_CHAT, "temperature": 3}, 400, "temperature"),
    ("top_p 1.5", CHAT_URL, {**OK_CHAT, "top_p": 1.5}, 400, "top_p"),
    ("presence_penalty 5", CHAT_URL, {**OK_CHAT, "presence_penalty": 5}, 400, "presence_penalty"),
    ("frequency_penalty bool", CHAT_URL, {**OK_CHAT, "frequency_penalty": True}, 400, "frequency_penalty"),
    ("max_tokens -1", CHAT_URL, {**OK_CHAT, "max_tokens": -1}, 400, "max_tokens"),
    ("max_tokens 0", COMP_URL, {**OK_COMP, "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens absurd", CHAT_URL, {**OK_CHAT, "max_tokens": 10**12}, 400, "max_tokens"),
    ("max_tokens string", CHAT_URL, {**OK_CHAT, "max_tokens": "10"}, 400, "max_tokens"),
    ("stream string", CHAT_URL, {**OK_CHAT, "stream": "yes"}, 400, "stream"),
    ("stream_options without stream", CHAT_URL, {**OK_CHAT, "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ("top_logprobs without logprobs", CHAT_URL, {**OK_CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("top_logprobs 50", CHAT_URL, {**OK_CHAT, "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs"),
    ("seed string", CHAT_URL, {**OK_CHAT, "seed": "abc"}, 400, "seed"),
    ("stop list of ints", COMP_URL, {**OK_COMP, "stop": [1]}, 400, None),
    ("empty stop string", COMP_URL, {**OK_COMP, "stop": [""]}, 400, "stop"),
    ("unknown model", CHAT_URL, {**OK_CHAT, "model": "gpt-9"}, 404, "model"),
    ("no prompt", COMP_URL, {"model": MODEL}, 400, "prompt"),
    ("empty prompt", COMP_URL, {**OK_COMP, "prompt": ""}, 400, "prompt"),
    ("token id outside vocab", COMP_URL, {**OK_COMP, "prompt": [1, 999999]}, 400, "prompt"),
    ("two prompts", COMP_URL, {**OK_COMP, "prompt": ["a", "b"]}, 400, "prompt"),
    ("prompt over context", COMP_URL, {**OK_COMP, "prompt": "x" * (CTX + 10)}, 400, "prompt"),
    ("prompt + max_tokens over context", COMP_URL, {**OK_COMP, "prompt": "x" * 500, "max_tokens": 100}, 400,
     "max_tokens"),
    ("completions logprobs 50", COMP_URL, {**OK_COMP, "logprobs": 50}, 400, "logprobs"),
    ("n 200", CHAT_URL, {**OK_CHAT, "n": 200}, 400, "n"),
    ("echo on chat", CHAT_URL, {**OK_CHAT, "echo": True}, 400, "echo"),
    ("logit_bias not an id", CHAT_URL, {**OK_CHAT, "logit_bias": {"x": 10}}, 400, "logit_bias"),
    ("logit_bias id outside vocab", CHAT_URL, {**OK_CHAT, "logit_bias": {"5000": 10}}, 400, "logit_bias"),
    ("logit_bias 101", CHAT_URL, {**OK_CHAT, "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("invalid json schema", CHAT_URL, {**OK_CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "frobnicate"}}}}, 400, None),
    ("unsatisfiable json schema", CHAT_URL, {**OK_CHAT, "guided_json": {"type": "integer", "minimum": 3,
                                                                        "maximum": 1}}, 400, None),
    ("bad regex", COMP_URL, {**OK_COMP, "guided_regex": "(a"}, 400, None),
    ("bad gbnf", COMP_URL, {**OK_COMP, "grammar": "root ::= undefined"}, 400, None),
    ("two constraints", CHAT_URL, {**OK_CHAT, "guided_regex": "a", "response_format": {"type": "json_object"}},
     400, "guided_regex"),
    ("unknown response_format", CHAT_URL, {**OK_CHAT, "response_format": {"type": "yaml"}}, 400,
     "response_format.type"),
    ("json_schema without schema", CHAT_URL, {**OK_CHAT, "response_format": {"type": "json_schema"}}, 400,
     "response_format.json_schema"),
    ("guided_choice empty", CHAT_URL, {**OK_CHAT, "guided_choice": []}, 400, "guided_choice"),
    ("tool_choice unknown function", CHAT_URL, {**OK_CHAT, "tools": [TOOL], "tool_choice": {
        "type": "function", "function": {"name": "nope"}}}, 400, "tool_choice"),
    ("tool_choice without tools", CHAT_URL, {**OK_CHAT, "tool_choice": "required"}, 400, "tool_choice"),
    ("tool_choice word", CHAT_URL, {**OK_CHAT, "tools": [TOOL], "tool_choice": "always"}, 400, "tool_choice"),
    ("tool without name", CHAT_URL, {**OK_CHAT, "tools": [{"type": "function", "function": {}}]}, 400, "tools"),
    ("tool with bad schema", CHAT_URL, {**OK_CHAT, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "frobnicate"}}}], "tool_choice": "required"}, 400, None),
    ("tools twice", CHAT_URL, {**OK_CHAT, "tools": [TOOL, TOOL]}, 400, "tools"),
]


@pytest.mark.parametrize("path,body,status,param", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input(srv: ServerThread, path: str, body: Any, status: int, param: str | None) -> None:
    engine = srv.engine.engine  # type: ignore[attr-defined]
    arrived = engine.metrics.arrived
    content_type = "application/json"
    if isinstance(body, tuple):
        body, content_type = body
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(srv.url + path, content=content, headers={"content-type": content_type})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err
    assert engine.metrics.arrived == arrived, "a rejected request reached the engine"


def test_health_503_while_loading_then_serves(tiny: Tiny) -> None:
    app = create_app(None, None, MODEL)
    st = ServerThread(app).start()
    try:
        health = httpx.get(st.url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "loading"
        r = httpx.post(st.url + COMP_URL, json=OK_COMP)
        assert r.status_code == 503 and r.json()["error"]["code"] == "loading" and r.headers["retry-after"]
        assert "twinfer_engine_up 0.0" in httpx.get(st.url + "/metrics").text
        engine = AsyncEngine(tiny.engine())
        engine.start()
        app.state.twinfer.attach(engine, tiny.tokenizer)
        assert httpx.get(st.url + "/health").status_code == 200
        assert httpx.post(st.url + COMP_URL, json=OK_COMP).status_code == 200
        st.call(engine.shutdown(drain=True, grace_s=5))
    finally:
        st.stop()


def test_routes_and_vendor_extras(srv: ServerThread) -> None:
    assert httpx.get(srv.url + CHAT_URL).status_code == 405
    missing = httpx.get(srv.url + "/v1/nothing")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    extras = {**OK_CHAT, "guided_json": {"type": "object"}, "user": "u1", "metadata": {"k": "v"}, "top_k": 5,
              "min_p": 0.1, "repetition_penalty": 1.1, "messages": [{"role": "developer", "content": "x"},
                                                                    {"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    r = httpx.post(srv.url + CHAT_URL, json=extras)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 2
    texts = [httpx.post(srv.url + COMP_URL, json={**OK_COMP, "max_tokens": 8, **extra}).json()["choices"][0]["text"]
             for extra in ({"temperature": 0}, {"temperature": 1e-300}, {"top_p": 0})]
    assert texts[0] == texts[1] == texts[2]  # tiny temperatures and top_p 0 are greedy, not NaN


def test_body_size_limit(tiny: Tiny) -> None:
    with serving(tiny, max_body_bytes=64 * 1024) as st:
        big = json.dumps({**OK_COMP, "prompt": "x" * 100_000}).encode()
        r = httpx.post(st.url + COMP_URL, content=big, headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

        def chunks() -> Iterator[bytes]:  # no Content-Length: the limit is enforced while reading
            for i in range(0, len(big), 8192):
                yield big[i:i + 8192]

        with contextlib.suppress(httpx.TransportError):
            r = httpx.post(st.url + COMP_URL, content=chunks(), headers={"content-type": "application/json"})
            assert r.status_code == 413
        assert st.engine.engine.metrics.arrived == 0  # type: ignore[attr-defined]


def test_fuzzed_bodies_never_5xx(srv: ServerThread) -> None:
    """Hypothesis-made bodies, mostly valid values with junk mixed in: only 200/400/404, never a hang."""
    hypothesis = pytest.importorskip("hypothesis")
    st_ = hypothesis.strategies
    junk = st_.one_of(st_.none(), st_.booleans(), st_.integers(-10**6, 10**6), st_.floats(allow_nan=False),
                      st_.text(max_size=8), st_.lists(st_.integers(-5, 400), max_size=4),
                      st_.dictionaries(st_.text(max_size=4), st_.integers(), max_size=2))

    def bodies(mostly: Any) -> Any:
        """(path, body) cases whose values come from `mostly(valid values)`."""
        message = st_.fixed_dictionaries({"role": mostly(st_.sampled_from(["user", "system", "assistant", "developer"])),
                                          "content": mostly(st_.text(max_size=20))})
        optional = {
            "model": mostly(st_.just(MODEL)), "temperature": mostly(st_.floats(0, 2)), "top_p": mostly(st_.floats(0, 1)),
            "stop": mostly(st_.one_of(st_.text(min_size=1, max_size=3),
                                      st_.lists(st_.text(min_size=1, max_size=3), max_size=3))),
            "stream": mostly(st_.booleans()), "seed": mostly(st_.integers(0, 2**64 - 1)),
            "presence_penalty": mostly(st_.floats(-2, 2)), "frequency_penalty": mostly(st_.floats(-2, 2)),
            "n": mostly(st_.just(1)), "top_k": mostly(st_.integers(-1, 50)), "ignore_eos": mostly(st_.booleans()),
            "user": mostly(st_.text(max_size=5)),
        }
        chat = st_.fixed_dictionaries(
            {"messages": mostly(st_.lists(message, min_size=1, max_size=3)), "max_tokens": mostly(st_.integers(1, 6))},
            optional={**optional, "logprobs": mostly(st_.just(True)), "top_logprobs": mostly(st_.integers(0, 20))})
        completion = st_.fixed_dictionaries(
            {"prompt": mostly(st_.one_of(st_.text(min_size=1, max_size=20),
                                         st_.lists(st_.integers(0, VOCAB - 1), min_size=1, max_size=5))),
             "max_tokens": mostly(st_.integers(1, 6))},
            optional={**optional, "logprobs": mostly(st_.integers(0, 5)), "vendor_extra": junk})
        return st_.one_of(st_.tuples(st_.just(CHAT_URL), chat), st_.tuples(st_.just(COMP_URL), completion))

    cases = st_.one_of(bodies(lambda valid: valid), bodies(lambda valid: st_.one_of(valid, junk)))
    statuses: list[int] = []

    @hypothesis.settings(max_examples=100, deadline=None, derandomize=True, database=None,
                         suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(case=cases)
    def check(case: tuple[str, dict[str, Any]]) -> None:
        path, body = case
        r = httpx.post(srv.url + path, content=json.dumps(body), timeout=30,  # Infinity and all
                       headers={"content-type": "application/json"})
        statuses.append(r.status_code)
        assert r.status_code in (200, 400, 404), (r.status_code, r.text, body)
        if r.status_code == 200 and body.get("stream") is True:
            assert r.text.rstrip().endswith("data: [DONE]")
        elif r.status_code != 200:
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}

    check()
    assert statuses.count(200) >= 10 and statuses.count(400) >= 10, statuses  # both paths were exercised


# -- auth, overload, disconnects, drain, a dead engine ---------------------------------------------------
def test_api_key_required_and_nothing_generated(tiny: Tiny, srv: ServerThread) -> None:
    with serving(tiny, api_key="sekrit") as st:
        engine = st.engine.engine  # type: ignore[attr-defined]
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"},
                        {"Authorization": "Basic c2Vrcml0"}):
            r = httpx.post(st.url + CHAT_URL, json=OK_CHAT, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert httpx.get(st.url + "/v1/models").status_code == 401
        with pytest.raises(openai.AuthenticationError):
            client(st, "wrong").chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)
        assert engine.metrics.arrived == 0 and engine.metrics.generated_tokens == 0
        assert httpx.get(st.url + "/health").status_code == 200
        r = client(st, "sekrit").chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)
        assert r.usage.completion_tokens >= 1 and engine.metrics.arrived == 1
        # two apps in one process keep separate registries
        assert metric(st, 'twinfer_http_requests_total{route="/v1/chat/completions",status="401"}') == 5
        assert 'status="401"' not in httpx.get(srv.url + "/metrics").text


class Stream:
    """A streaming response being read line by line (keep it: dropping the iterator closes the connection)."""

    def __init__(self, response: httpx.Response):
        self.response = response
        self.lines = response.aiter_lines()

    async def data(self, n: int) -> None:
        """Read until `n` data lines have arrived."""
        seen = 0
        while seen < n:
            if (await self.lines.__anext__()).startswith("data: "):
                seen += 1

    async def rest(self) -> list[Any]:
        return sse_events([line async for line in self.lines])

    async def aclose(self) -> None:
        await self.response.aclose()


async def _open_stream(c: httpx.AsyncClient, url: str, body: dict[str, Any], chunks: int) -> Stream:
    """Start a streaming request and read `chunks` data lines; the caller closes it."""
    r = await c.send(c.build_request("POST", url, json={**body, "stream": True}), stream=True)
    assert r.status_code == 200, await r.aread()
    stream = Stream(r)
    await stream.data(chunks)
    return stream


LONG = {"model": MODEL, "prompt": "a long one", "max_tokens": 400, "ignore_eos": True}


def test_overload_429_with_retry_after(tiny: Tiny) -> None:
    with serving(tiny, max_seqs=1, max_queue=1) as st:
        async def run() -> None:
            async with httpx.AsyncClient(timeout=30) as c:
                running = await _open_stream(c, st.url + COMP_URL, LONG, 1)
                waiting = await c.send(c.build_request("POST", st.url + COMP_URL, json={**LONG, "stream": True}),
                                       stream=True)
                assert waiting.status_code == 200
                r = await c.post(st.url + COMP_URL, json=OK_COMP)
                assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
                assert r.json()["error"]["code"] == "overloaded"
                await running.aclose()
                await waiting.aclose()
            for _ in range(200):  # the dropped requests leave; then there is room again
                if st.engine.active == 0:  # type: ignore[attr-defined]
                    break
                await asyncio.sleep(0.02)
            async with httpx.AsyncClient(timeout=30) as c:
                assert (await c.post(st.url + COMP_URL, json=OK_COMP)).status_code == 200

        asyncio.run(run())


def test_disconnects_free_kv_blocks(srv: ServerThread) -> None:
    baseline = metric(srv, "twinfer_kv_blocks_used")
    engine = srv.engine.engine  # type: ignore[attr-defined]
    aborted = engine.metrics.finished["abort"]

    async def run() -> float:
        async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=16)) as c:
            streams = await asyncio.gather(*(
                _open_stream(c, srv.url + (CHAT_URL if i % 2 else COMP_URL),
                             {**LONG, "prompt": f"client {i} " * 8, "messages": [{"role": "user", "content": f"c{i}"}]}, 3)
                for i in range(8)))
            used = metric(srv, "twinfer_kv_blocks_used")
            await asyncio.gather(*(s.aclose() for s in streams))
        return used

    busy = asyncio.run(run())
    assert busy >= baseline + 8
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (metric(srv, "twinfer_kv_blocks_used") != baseline
                                           or metric(srv, "twinfer_requests_active") != 0):
        time.sleep(0.05)
    assert metric(srv, "twinfer_kv_blocks_used") == baseline
    assert metric(srv, "twinfer_requests_active") == 0
    assert engine.metrics.finished["abort"] == aborted + 8
    assert not engine.requests  # finished requests are not kept
    engine.blocks.check()


def test_drain_finishes_in_flight_and_refuses_new(tiny: Tiny) -> None:
    with serving(tiny, grace_s=30) as st:
        async def run() -> list[Any]:
            async with httpx.AsyncClient(timeout=30) as c:
                r = await _open_stream(c, st.url + COMP_URL, {**LONG, "max_tokens": 120}, 1)
                st.drain()
                for _ in range(100):
                    if (await c.get(st.url + "/health")).status_code == 503:
                        break
                    await asyncio.sleep(0.01)
                health = await c.get(st.url + "/health")
                assert health.status_code == 503 and health.json()["status"] == "draining"
                refused = await c.post(st.url + COMP_URL, json=OK_COMP)
                assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
                events = await r.rest()
                await r.aclose()
                return events

        events = asyncio.run(run())
        assert events[-1] == "[DONE]"
        assert [e["choices"][0].get("finish_reason") for e in events[:-1]][-1] == "length"
        st._thread.join(10)
        assert not st._thread.is_alive(), "the server did not exit after draining"


def test_drain_grace_period_ends_requests_with_a_reason(tiny: Tiny) -> None:
    with serving(tiny, grace_s=0.2) as st:
        async def run() -> list[Any]:
            async with httpx.AsyncClient(timeout=30) as c:
                r = await _open_stream(c, st.url + CHAT_URL, {**LONG, "messages": CHAT, "max_tokens": 400}, 1)
                st.drain()
                return await r.rest()

        events = asyncio.run(run())
        assert events[-1] == "[DONE]"
        assert any("error" in e and e["error"]["code"] == "shutting_down" for e in events[:-1])
        assert events[-2]["choices"][0]["finish_reason"] == "abort"


class Exploding(Runner):
    """A runner that fails on its `after`-th step, as a backend crash would."""

    def __init__(self, inner: Runner, after: int):
        self.inner, self.after, self.steps = inner, after, 0
        self.spec, self.kv, self.backend = inner.spec, inner.kv, inner.backend

    def step(self, batch: Any) -> Any:
        self.steps += 1
        if self.steps >= self.after:
            raise RuntimeError("device lost")
        return self.inner.step(batch)


def test_engine_death_reaches_every_client(tiny: Tiny) -> None:
    with serving(tiny, max_seqs=1, runner=Exploding(tiny.runner(), after=20)) as st:
        async def run() -> None:
            async with httpx.AsyncClient(timeout=10) as c:
                streaming = await _open_stream(c, st.url + COMP_URL, LONG, 1)
                queued = asyncio.create_task(c.post(st.url + COMP_URL, json=LONG))  # waits behind it
                events = await streaming.rest()
                assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "engine_failed"
                r = await asyncio.wait_for(queued, 5)
                assert r.status_code == 503 and "device lost" in r.json()["error"]["message"]
                assert (await c.post(st.url + COMP_URL, json=OK_COMP)).status_code == 503
                health = await c.get(st.url + "/health")
                assert health.status_code == 503 and health.json()["status"] == "failed"

        asyncio.run(run())
        assert metric(st, "twinfer_engine_up") == 0


def test_async_engine_api(tiny: Tiny) -> None:
    async def run() -> None:
        engine = tiny.engine(max_seqs=1)
        ae = AsyncEngine(engine, max_queue=0)
        ae.start()
        params = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True, guard=NO_GUARD)
        stream = await ae.generate([5, 6, 7], params, request_id="a")
        first = await stream.__anext__()
        assert first.token_ids and not first.finished
        with pytest.raises(Overloaded):
            await ae.generate([5, 6, 7], params)
        ae.abort("a")
        outs = [o async for o in stream]
        assert outs[-1].finished and outs[-1].finish_reason == "abort"
        short = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, guard=NO_GUARD)
        got = [o async for o in await ae.generate([5, 6, 7], short)]
        assert sum(len(o.token_ids) for o in got) == 4 and got[-1].finish_reason == "length"
        await ae.shutdown(drain=True, grace_s=1)
        assert not ae.alive and engine.blocks.num_used == 0
        with pytest.raises(ShuttingDown):
            await ae.generate([5], short)

    asyncio.run(run())


def test_http_bench_shape(srv: ServerThread) -> None:
    out = run_http_bench(srv.url, [1, 3], prompt_tokens=8, output_tokens=6, requests_per_client=2)
    assert set(out) >= {"hardware", "build", "traffic", "results"}
    assert [r["concurrency"] for r in out["results"]] == [1, 3]
    for r in out["results"]:
        assert r["requests"] == 2 * r["concurrency"] and r["output_tokens"] == 6 * r["requests"]
        assert r["output_tokens_per_s"] > 0 and 0 < r["ttft_p50_s"] <= r["ttft_p99_s"]
        assert 0 < r["tpot_p50_s"] <= r["tpot_p99_s"]
    assert out["build"]["server"]["backend"] == "torch"


def test_load_16_clients_x_8_requests_all_complete(srv: ServerThread) -> None:
    engine = srv.engine.engine  # type: ignore[attr-defined]
    finished = sum(engine.metrics.finished.values())
    out = run_http_bench(srv.url, [16], prompt_tokens=24, output_tokens=8, requests_per_client=8)
    r = out["results"][0]
    assert r["requests"] == 128 and r["output_tokens"] == 128 * 8
    assert sum(engine.metrics.finished.values()) == finished + 128 + 1  # and the bench's warm-up request
    assert metric(srv, "twinfer_requests_active") == 0 and metric(srv, "twinfer_kv_blocks_used") == 0
