"""The first constrained request must not freeze the server: llguidance's tokenizer is built when a
model is attached (before any request is served), and a request that finds it unbuilt waits for it
on a worker thread while the event loop and the engine keep serving other streams.

The model is test_server's tiny random llama; the build is gated by a test event, so the checks are
on ordering (what answered while the build was held), not on timings.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("llguidance")

from test_server import MODEL, NO_GUARD, Tiny, build_tiny, one_torch_thread  # noqa: E402

import twinfer.runtime.constraints.compile as compile_mod  # noqa: E402
from twinfer.backends.cuda.runner import build_torch_runner  # noqa: E402
from twinfer.runtime.engine import Engine, EngineConfig  # noqa: E402
from twinfer.runtime.engine.async_engine import AsyncEngine  # noqa: E402
from twinfer.server import create_app  # noqa: E402
from twinfer.server.serve import ServerThread  # noqa: E402

CTX = 512
JSON_ASK = {"model": MODEL, "messages": [{"role": "user", "content": "a person"}], "max_tokens": 40,
            "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {
                "type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 99}},
                "required": ["age"], "additionalProperties": False}}}}


@pytest.fixture(scope="module")
def tiny() -> Iterator[Tiny]:
    with one_torch_thread():
        yield build_tiny()


def _engine(tiny: Tiny) -> AsyncEngine:
    runner = build_torch_runner(tiny.spec, tiny.weights, kv_tokens=4 * CTX, block_size=16)
    return AsyncEngine(Engine(runner, tiny.tokenizer, EngineConfig(max_seqs=4, max_context=CTX)))


class Gate:
    """Stands in for llguidance's tokenizer build: counts builds and holds each until released."""

    def __init__(self) -> None:
        self.real = compile_mod._ll_tokenizer
        self.entered = threading.Event()
        self.release = threading.Event()
        self.builds = 0

    def __call__(self, tokenizer: Any, vocab_size: int) -> Any:
        self.builds += 1
        self.entered.set()
        assert self.release.wait(60), "the test never released the build"
        return self.real(tokenizer, vocab_size)


def test_a_request_waits_for_the_build_while_other_streams_advance(tiny: Tiny,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    gate = Gate()
    monkeypatch.setattr(compile_mod, "_ll_tokenizer", gate)
    engine = _engine(tiny)
    engine.start()
    st = ServerThread(create_app(engine, tiny.tokenizer, MODEL, guard=NO_GUARD)).start()
    try:
        plain = {"model": MODEL, "prompt": "abc", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=st.url, timeout=60) as http, http.stream("POST", "/v1/completions",
                                                                           json=plain) as stream:
            lines = (line for line in stream.iter_lines() if line.startswith("data: {"))
            next(lines)
            answer: dict[str, Any] = {}
            asker = threading.Thread(target=lambda: answer.update(
                r=httpx.post(st.url + "/v1/chat/completions", json=JSON_ASK, timeout=60)))
            asker.start()
            assert gate.entered.wait(60), "the constrained request never started the build"
            health = http.get("/health")  # the event loop answers while the build is held
            assert health.status_code == 200 and health.json()["status"] == "ok"
            advanced = [next(lines) for _ in range(5)]  # and the other stream keeps getting tokens
            assert len(advanced) == 5 and asker.is_alive() and "r" not in answer
            gate.release.set()
            asker.join(60)
        r = answer["r"]
        assert r.status_code == 200, r.text
        assert isinstance(json.loads(r.json()["choices"][0]["message"]["content"])["age"], int)
        assert gate.builds == 1
    finally:
        gate.release.set()
        st.call(engine.shutdown(drain=False), timeout_s=10)
        st.stop()


def test_attach_builds_the_tokenizer_before_the_model_is_served(tiny: Tiny,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    gate = Gate()
    gate.release.set()
    monkeypatch.setattr(compile_mod, "_ll_tokenizer", gate)
    app = create_app(None, None, MODEL, guard=NO_GUARD)
    st = ServerThread(app).start()
    engine = _engine(tiny)
    engine.start()
    try:
        assert httpx.get(st.url + "/health").json()["status"] == "loading"
        app.state.twinfer.attach(engine, tiny.tokenizer)
        assert gate.builds == 1 and engine.engine.grammars._ll_tokenizer is not None
        r = httpx.post(st.url + "/v1/chat/completions", json=JSON_ASK, timeout=60)
        assert r.status_code == 200, r.text
        assert "age" in json.loads(r.json()["choices"][0]["message"]["content"])
        assert gate.builds == 1  # the request found it built
    finally:
        st.call(engine.shutdown(drain=False), timeout_s=10)
        st.stop()
