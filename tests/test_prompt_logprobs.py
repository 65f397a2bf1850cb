"""Prompt logprobs: `/v1/completions` with `echo` + `logprobs` (and vLLM's `prompt_logprobs`) in one request.

Served from the default GGUF on the llama.cpp runner with the prefix cache on (the server's default).
A request that scores its prompt computes the whole prompt in chunks at multiples of
`max_prefill_chunk` and reads no cached prefix, so its logprobs are bit-identical to one
`RunnerSource.logits` step over the same window; the format is vLLM's (the token itself, then the top k).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

pytest.importorskip("llama_cpp")
openai = pytest.importorskip("openai")

from twinfer.app.models import open_model  # noqa: E402
from twinfer.quant.fidelity import RunnerSource, corpus_windows  # noqa: E402
from twinfer.quant.kl import log_softmax  # noqa: E402
from twinfer.runtime.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from twinfer.runtime.engine.async_engine import AsyncEngine  # noqa: E402
from twinfer.runtime.engine.request import Request  # noqa: E402
from twinfer.runtime.engine.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from twinfer.runtime.kv.block_manager import BlockManager  # noqa: E402
from twinfer.server import create_app  # noqa: E402
from twinfer.server.serve import ServerThread  # noqa: E402

NAME = "gemma-3-270m"
PROMPT = "The quick brown fox jumps over the lazy dog because"


@pytest.fixture(scope="module")
def window() -> list[int]:
    (w,) = corpus_windows(None, "prose", 32, 33)  # BOS + 32 tokens
    return w


@pytest.fixture(scope="module")
def reference(window: list[int]) -> np.ndarray:
    """log_softmax of one RunnerSource step over the window: what `eval kl` scores against."""
    return log_softmax(RunnerSource(open_model(None, "llamacpp", max_seqs=2, ctx=512, threads=1).runner).logits(window))


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[ServerThread, Engine, Any]]:
    o = open_model(None, "llamacpp", max_seqs=2, ctx=512, threads=1)
    engine = Engine(o.runner, o.tokenizer, EngineConfig(max_seqs=2, max_context=512))  # prefix cache on
    async_engine = AsyncEngine(engine)
    async_engine.start()
    st = ServerThread(create_app(async_engine, o.tokenizer, NAME)).start()
    yield st, engine, o.tokenizer
    st.call(async_engine.shutdown(drain=False))
    st.stop()


def client(st: ServerThread) -> Any:
    return openai.OpenAI(base_url=st.url + "/v1", api_key="none", max_retries=0, timeout=120)


def test_echo_logprobs_format_through_the_openai_client(served: tuple[ServerThread, Engine, Any]) -> None:
    st, _, tok = served
    ids = tok.encode(PROMPT)
    r = client(st).completions.create(model=NAME, prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=5)
    choice = r.choices[0]
    lp = choice.logprobs
    n = len(ids) + 3
    assert choice.text.startswith(PROMPT) and r.usage.prompt_tokens == len(ids)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert lp.tokens[: len(ids)] == [tok.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]
    for token, logprob, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True):
        assert logprob <= 0 and 5 <= len(top) <= 6  # the token itself, then the 5 most likely
        assert token in top  # with its own logprob, unless another id decodes to the same piece
        assert max(top.values()) >= logprob
    greedy = lp.token_logprobs[len(ids):]  # greedy: each generated token is the most likely
    assert all(max(top.values()) == g for top, g in zip(lp.top_logprobs[len(ids):], greedy, strict=True))
    vllm = choice.model_extra["prompt_logprobs"]  # vLLM's extension: ids -> logprob, rank, decoded token
    assert vllm[0] is None and len(vllm) == len(ids)
    for i, row in enumerate(vllm[1:], 1):
        assert row[str(ids[i])]["logprob"] == lp.token_logprobs[i] and row[str(ids[i])]["rank"] >= 1
        assert {1, 2, 3, 4, 5} <= {e["rank"] for e in row.values()} and len(row) <= 6

    stream = client(st).completions.create(model=NAME, prompt=PROMPT, max_tokens=3, temperature=0, echo=True,
                                           logprobs=5, stream=True)
    chunks = [c.choices[0] for c in stream if c.choices]
    assert "".join(c.text for c in chunks) == choice.text
    assert chunks[0].text == PROMPT and len(chunks[0].logprobs.tokens) == len(ids)  # the echo carries the prompt's
    joined = [x for c in chunks if c.logprobs for x in c.logprobs.token_logprobs]
    assert joined == lp.token_logprobs
    assert [x for c in chunks if c.logprobs for x in c.logprobs.text_offset] == lp.text_offset

    only = client(st).completions.create(model=NAME, prompt=ids, max_tokens=0, echo=True, logprobs=2)
    assert only.choices[0].text == tok.decode(ids, True) and len(only.choices[0].logprobs.tokens) == len(ids)
    assert only.choices[0].logprobs.token_logprobs == lp.token_logprobs[: len(ids)]  # same prompt, same numbers
    streamed = [c.choices[0] for c in client(st).completions.create(
        model=NAME, prompt=ids, max_tokens=0, echo=True, logprobs=2, stream=True) if c.choices]
    assert "".join(c.text for c in streamed) == only.choices[0].text
    assert [x for c in streamed if c.logprobs for x in c.logprobs.token_logprobs] == lp.token_logprobs[: len(ids)]


def test_served_prompt_logprobs_are_bit_identical_to_runner_source(served: tuple[ServerThread, Engine, Any]) -> None:
    """100 tokens (one chunk of >= 64 rows: llama.cpp's tiled flash attention) after a 120-token request
    the server keeps in a slot: the scored request neither reads that cached prefix nor computes after
    its cells (starting mid-tile, they change most rows' logits), so it matches a fresh
    runner exactly."""
    st, engine, _ = served
    (long,) = corpus_windows(None, "prose", 119, 120)
    window = long[:100]
    reference = log_softmax(RunnerSource(open_model(None, "llamacpp", max_seqs=2, ctx=512, threads=1).runner
                                         ).logits(window))
    c = client(st)
    c.completions.create(model=NAME, prompt=long, max_tokens=1, temperature=0)  # its blocks are now cached
    r = c.completions.create(model=NAME, prompt=window, max_tokens=1, temperature=0, echo=True, logprobs=20)
    assert r.usage.prompt_tokens_details.cached_tokens == 0  # a scored prompt reads no cached prefix
    vllm = r.choices[0].model_extra["prompt_logprobs"]
    lp = r.choices[0].logprobs
    for i in range(1, len(window)):
        row = reference[i - 1]
        assert lp.token_logprobs[i] == float(row[window[i]])  # exactly: KL 0
        best = np.argsort(-row, kind="stable")[:20]
        assert {int(t): e["logprob"] for t, e in vllm[i].items() if e["rank"] <= 20} == {
            int(t): float(row[t]) for t in best}
    after = c.completions.create(model=NAME, prompt=window, max_tokens=1, temperature=0)
    assert after.usage.prompt_tokens_details.cached_tokens == 96  # it still registered its blocks for others
    engine.blocks.check()


@pytest.mark.parametrize("body, param", [
    ({"prompt": PROMPT, "echo": True, "logprobs": 21}, "logprobs"),
    ({"prompt": PROMPT, "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "echo": True, "logprobs": True}, "echo"),
    ({"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 2}, "prompt_logprobs"),
], ids=["logprobs-21", "prompt_logprobs-21", "max_tokens-0-without-echo", "chat-echo", "chat-prompt_logprobs"])
def test_bad_prompt_logprobs_requests_are_clear_400s(served: tuple[ServerThread, Engine, Any], body: dict[str, Any],
                                                    param: str) -> None:
    st = served[0]
    route = "chat/completions" if "messages" in body else "completions"
    r = httpx.post(f"{st.url}/v1/{route}", json={"model": NAME, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert param in (err.get("param") or "") + err["message"] and "\n" not in err["message"]


def test_engine_scores_without_reading_the_cache_and_frees_every_block(
        served: tuple[ServerThread, Engine, Any], window: list[int], reference: np.ndarray) -> None:
    o = open_model(None, "llamacpp", max_seqs=2, ctx=512, threads=1)
    engine = Engine(o.runner, o.tokenizer, EngineConfig(max_seqs=2, max_context=512))
    idle = engine.blocks.num_free
    (plain,) = engine.generate([window], SamplingParams(max_tokens=2, temperature=0))
    (scored,) = engine.generate([window], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3))
    (again,) = engine.generate([window], SamplingParams(max_tokens=2, temperature=0))
    assert plain.cached_tokens == 0 and scored.cached_tokens == 0 and again.cached_tokens == 32
    assert scored.token_ids == plain.token_ids == again.token_ids
    assert scored.prompt_logprobs is not None and len(scored.prompt_logprobs) == len(window) - 1
    assert [x.logprob for x in scored.prompt_logprobs] == [float(reference[i][window[i + 1]]) for i in range(32)]
    assert all(x.top is not None and len(x.top) == 3 and x.rank is not None for x in scored.prompt_logprobs)
    assert plain.prompt_logprobs is None
    assert engine.blocks.num_free == idle and not engine.blocks.seqs
    engine.blocks.check()
    engine.close()


def test_scored_prompt_chunks_keep_to_multiples_of_the_chunk_size() -> None:
    """A decode takes one token of the step's budget: the scored prompt's first chunk ends one short of
    the chunk size, and its next chunk ends on the boundary before chunks go on at full size."""
    blocks = BlockManager(64, 4)
    sched = Scheduler(SchedulerConfig(max_batch_tokens=16, max_seqs=4, max_prefill_chunk=16), blocks)
    decoding = Request("d", 0, [1, 2, 3], SamplingParams(max_tokens=8))
    sched.add(decoding)
    assert [s.request for s in sched.schedule().items] == [decoding]
    decoding.num_computed, decoding.output = 3, [4]
    scored = Request("s", 1, list(range(5, 45)), SamplingParams(max_tokens=1, prompt_logprobs=0))
    sched.add(scored)
    spans = []
    for _ in range(5):
        for s in sched.schedule().items:
            if s.request is scored:
                spans.append((s.request.num_computed, s.request.num_computed + s.num_tokens))
                s.request.num_computed += s.num_tokens
            else:
                s.request.num_computed += s.num_tokens
                s.request.output.append(7)
        if scored.num_computed == len(scored.prompt):
            break
    assert spans == [(0, 15), (15, 16), (16, 31), (31, 32), (32, 40)]


@pytest.mark.slow
def test_a_window_past_one_chunk_is_bit_identical_too() -> None:
    """530 tokens: the engine computes chunks [0, 512) and [512, 530), as llama.cpp splits the one
    RunnerSource step into n_batch windows; a cached prefix from an earlier request is not read."""
    (w,) = corpus_windows(None, "prose", 529, 530)
    ref = log_softmax(RunnerSource(open_model(None, "llamacpp", max_seqs=2, ctx=1024, threads=1).runner).logits(w))
    o = open_model(None, "llamacpp", max_seqs=2, ctx=1024, threads=1)
    engine = Engine(o.runner, o.tokenizer, EngineConfig(max_seqs=2, max_context=1024))
    engine.generate([w[:300]], SamplingParams(max_tokens=1, temperature=0))
    (out,) = engine.generate([w], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=5))
    assert out.cached_tokens == 0 and out.prompt_logprobs is not None
    assert [x.logprob for x in out.prompt_logprobs] == [float(ref[i][w[i + 1]]) for i in range(len(w) - 1)]
    assert [[t for t, _ in x.top or []] for x in out.prompt_logprobs] == [
        [int(t) for t in np.argsort(-ref[i], kind="stable")[:5]] for i in range(len(w) - 1)]
    engine.close()
