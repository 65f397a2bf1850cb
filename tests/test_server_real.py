"""`twinfer serve` on the real default model (Gemma 3 270M Q4_K_M) with the llama.cpp runner.

The `openai` client's greedy results must equal the same prompt run straight through an `Engine` on
a second, identically built runner; the chat template must be Gemma's. One test runs the real CLI in
a subprocess and drains it with SIGTERM.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

pytest.importorskip("llama_cpp")
openai = pytest.importorskip("openai")

from twinfer.app.models import OpenedModel, open_model  # noqa: E402
from twinfer.runtime.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from twinfer.runtime.engine.async_engine import AsyncEngine  # noqa: E402
from twinfer.server import create_app  # noqa: E402
from twinfer.server.serve import ServerThread  # noqa: E402

CTX, SEQS, THREADS = 1024, 4, 1  # one thread: llama.cpp's spinning thread pool collapses on a shared 2-core machine
NAME = "gemma-3-270m-q4_k_m"
MESSAGES = [{"role": "system", "content": "You are a helpful assistant. Answer in one short sentence, in plain English."},
            {"role": "user", "content": "Name three colors of the rainbow."}]  # > 2 KV blocks: the prefix cache engages


def opened() -> OpenedModel:
    return open_model(None, "llamacpp", max_seqs=SEQS, ctx=CTX, threads=THREADS)


@pytest.fixture(scope="module")
def reference() -> Engine:
    """An engine on its own runner, built like the server's: the path the HTTP layer must not change."""
    o = opened()
    return Engine(o.runner, o.tokenizer, EngineConfig(max_seqs=SEQS, max_context=CTX))


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[ServerThread, Any]]:
    o = opened()
    engine = AsyncEngine(Engine(o.runner, o.tokenizer, EngineConfig(max_seqs=SEQS, max_context=CTX)))
    engine.start()
    st = ServerThread(create_app(engine, o.tokenizer, NAME)).start()
    yield st, o.tokenizer
    st.call(engine.shutdown(drain=False))
    st.stop()


def run_alone(engine: Engine, prompt: list[int], **params: Any) -> Any:
    return engine.generate([prompt], SamplingParams(**params))[0]


def test_real_chat_applies_gemma_template_and_matches_engine(served: tuple[ServerThread, Any],
                                                             reference: Engine) -> None:
    st, tok = served
    ids = tok.encode_chat(MESSAGES)
    rendered = tok.decode(ids)
    assert rendered.startswith("<bos><start_of_turn>user\nYou are a helpful") and rendered.endswith("<start_of_turn>model\n")
    ref = run_alone(reference, ids, max_tokens=16, temperature=0.0)
    c = openai.OpenAI(base_url=st.url + "/v1", api_key="none", max_retries=0, timeout=120)
    r = c.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=16, temperature=0)
    assert r.choices[0].message.content == ref.text and ref.text.strip()
    assert r.choices[0].finish_reason == ref.finish_reason
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(ref.token_ids))
    chunks = list(c.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == ref.text
    assert chunks[-1].usage.prompt_tokens == len(ids)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the second run reused the prefix


def test_real_completion_logprobs_and_stop(served: tuple[ServerThread, Any], reference: Engine) -> None:
    st, tok = served
    prompt = "The capital of France is"
    ids = tok.encode(prompt)
    ref = run_alone(reference, ids, max_tokens=12, temperature=0.0, logprobs=3)
    c = openai.OpenAI(base_url=st.url + "/v1", api_key="none", max_retries=0, timeout=120)
    r = c.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == ref.text
    assert lp.token_logprobs == pytest.approx([x.logprob for x in ref.logprobs], abs=1e-3)
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 3 and max(top.values()) == pytest.approx(chosen, abs=1e-3)  # greedy: the best one
    words = re.findall(r"[A-Za-z]{3,}", ref.text)
    assert words, ref.text
    stop = words[min(1, len(words) - 1)]
    r = c.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == ref.text[: ref.text.index(stop)]


def _read_lines(stream: Any, out: queue.Queue[str]) -> None:
    for line in iter(stream.readline, ""):
        out.put(line)


def test_cli_serve_sigterm_drains(tmp_path: Any) -> None:
    """`twinfer serve` (here in --batch-invariant mode: per-sequence KV streams) drains on SIGTERM."""
    env = {**os.environ, "TWINFER_API_KEY": "k3y"}
    cmd = [sys.executable, "-m", "twinfer.cli.main", "serve", "--port", "0", "--max-seqs", "2", "--ctx", "512",
           "--threads", str(THREADS), "--log-level", "warning", "--drain-timeout", "60", "--batch-invariant"]
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=_read_lines, args=(proc.stderr, lines), daemon=True).start()
    try:
        url = None
        deadline = time.monotonic() + 60
        while url is None and time.monotonic() < deadline:
            try:
                line = lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                break
            m = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", line)
            url = m.group(1) if m else None
        assert url, "the server never said it was ready"
        auth = {"Authorization": "Bearer k3y"}
        assert httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 401
        body = {"prompt": "Once upon a time", "max_tokens": 24, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=60, headers=auth) as c, c.stream("POST", url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines_in = r.iter_lines()
            next(line for line in lines_in if line.startswith("data: "))
            proc.send_signal(signal.SIGTERM)
            for _ in range(100):
                refused = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, headers=auth)
                if refused.status_code == 503:
                    break
                time.sleep(0.02)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
            rest = [line for line in lines_in if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]" and '"finish_reason":"length"' in rest[-2]
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


