"""`twinfer bench --url`: closed-loop load through any OpenAI-compatible server, /v1/completions with
`ignore_eos`, streamed (TTFT and TPOT as a user sees them) or not, greedy or at the server's own sampling
defaults; each level reports the client's own CPU seconds, to show it is not the bottleneck."""

from __future__ import annotations

import asyncio
import json
import os
import platform
import random
import time
from dataclasses import dataclass
from typing import Any

from twinfer.runtime.engine.metrics import percentile
from twinfer.runtime.errors import TwinferError

_TEXT = ("time year people way day man thing woman life child world school state family student group "
         "country problem hand part place case week company system program question work government number "
         "night point home water room mother area money story fact month lot right study book eye job word "
         "business issue side kind head house service friend father power hour game line end member law car "
         "city community name president team minute idea kid body information back parent face others level "
         "office door health person art war history party result change morning reason research girl guy moment "
         "air teacher force education")
_WORDS = _TEXT.split()


class BenchError(TwinferError):
    """The server under test refused or broke a request."""


@dataclass
class Sample:
    ttft_s: float | None
    tpot_s: float | None
    output_tokens: int
    prompt_tokens: int


def prompt_key(clients: int, worker: int, i: int, seed: int) -> int:
    """The `bench_prompt` key of request `i` of `worker` in a level of `clients` (another seed, other prompts)."""
    return 1_000_003 * clients + 1009 * worker + i + 7_919_000_017 * seed


def bench_prompt(prompt_tokens: int, key: int) -> str:
    """About `prompt_tokens` tokens of common words, different for every key (no shared prefix)."""
    rng = random.Random(key)
    return " ".join(rng.choice(_WORDS) for _ in range(max(prompt_tokens, 1)))


@dataclass(frozen=True)
class HttpTraffic:
    """How each request is sent: streamed, greedy (else the server's sampling defaults), which prompts
    (another `prompt_seed`, other prompts: no prefix-cache hits) and `extra_body` merged into each."""

    stream: bool = True
    greedy: bool = True
    prompt_seed: int = 0
    extra_body: dict[str, Any] | None = None


def run_http_bench(url: str, concurrency: list[int], prompt_tokens: int, output_tokens: int,
                   api_key: str | None = None, *, requests_per_client: int = 4, model: str | None = None,
                   timeout_s: float = 600.0, traffic: HttpTraffic = HttpTraffic()) -> dict[str, Any]:
    """Drive `url` at each concurrency; returns {"hardware", "build", "traffic", "results"}."""
    if not concurrency or min(concurrency) < 1 or prompt_tokens < 1 or output_tokens < 1 or requests_per_client < 1:
        raise TwinferError("concurrency levels, --prompt-tokens, --output-tokens and requests per client must be >= 1")
    t = traffic
    extra = {"stream": t.stream, **({"temperature": 0.0} if t.greedy else {}), **(t.extra_body or {})}
    shape = _Shape(prompt_tokens, output_tokens, requests_per_client, extra, t.prompt_seed)
    return asyncio.run(_bench(url.rstrip("/"), concurrency, shape, api_key, model, timeout_s))


@dataclass(frozen=True)
class _Shape:
    prompt_tokens: int
    output_tokens: int
    per_client: int
    extra: dict[str, Any]  # merged into every request body
    seed: int


async def _bench(url: str, concurrency: list[int], shape: _Shape, api_key: str | None, model: str | None,
                 timeout_s: float) -> dict[str, Any]:
    import httpx

    prompt_tokens, output_tokens, per_client, extra, seed = (shape.prompt_tokens, shape.output_tokens,
                                                             shape.per_client, shape.extra, shape.seed)

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max(concurrency) + 4, max_keepalive_connections=max(concurrency) + 4)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout_s, limits=limits) as client:
        model, server = await _server_info(client, model)
        await _one(client, model, bench_prompt(prompt_tokens, -1 - seed), min(output_tokens, 4), extra)  # warm-up
        results = []
        for c in concurrency:
            results.append(await _level(client, model, c, per_client, prompt_tokens, output_tokens, extra, seed))
    return {
        "hardware": {"server": server.get("hardware"), "client": platform.platform(), "client_cpus": os.cpu_count()},
        "build": {"url": url, "model": model, "server": server.get("build")},
        "traffic": {"mode": "http", "endpoint": "/v1/completions", "stream": extra["stream"],
                    "prompt_tokens": prompt_tokens, "output_tokens": output_tokens, "requests_per_client": per_client,
                    "temperature": extra.get("temperature", "server default"),
                    "ignore_eos": True, "concurrency": list(concurrency)},
        "results": results,
    }


async def _server_info(client: Any, model: str | None) -> tuple[str, dict[str, Any]]:
    import httpx

    try:
        r = await client.get("/v1/models")
    except httpx.HTTPError as e:
        raise BenchError(f"cannot reach {client.base_url}: {e}") from e
    if r.status_code != 200:
        raise BenchError(f"GET /v1/models answered {r.status_code}: {r.text[:300]}")
    data = r.json().get("data") or [{}]
    model = model or data[0].get("id")
    if not model:
        raise BenchError("the server lists no model; pass one")
    server: dict[str, Any] = {}
    try:
        health = await client.get("/health")
        if health.headers.get("content-type", "").startswith("application/json"):
            server = {"build": health.json().get("build")}
    except httpx.HTTPError:
        pass
    return model, server


async def _level(client: Any, model: str, c: int, per_client: int, prompt_tokens: int,
                 output_tokens: int, extra: dict[str, Any], seed: int = 0) -> dict[str, Any]:
    samples: list[Sample] = []

    async def worker(w: int) -> None:
        for i in range(per_client):
            prompt = bench_prompt(prompt_tokens, prompt_key(c, w, i, seed))
            samples.append(await _one(client, model, prompt, output_tokens, extra))

    started, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(worker(w) for w in range(c)))
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    tokens = sum(s.output_tokens for s in samples)
    ttft = [s.ttft_s for s in samples if s.ttft_s is not None]
    tpot = [s.tpot_s for s in samples if s.tpot_s is not None]
    return {
        "concurrency": c,
        "output_tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "tpot_p50_s": percentile(tpot, 50), "tpot_p99_s": percentile(tpot, 99),
        "requests": len(samples), "output_tokens": tokens, "wall_s": wall, "client_cpu_s": cpu,
        "prompt_tokens_mean": sum(s.prompt_tokens for s in samples) / max(len(samples), 1),
    }  # fmt: skip


async def _one(client: Any, model: str, prompt: str, max_tokens: int, extra: dict[str, Any]) -> Sample:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, **extra}
    if not body.get("stream"):
        return await _one_whole(client, body)
    body["stream_options"] = {"include_usage": True}
    started = time.perf_counter()
    first = last = None
    chunks = 0
    usage: dict[str, Any] = {}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise BenchError(f"POST /v1/completions answered {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            obj = json.loads(data)
            if "error" in obj:
                raise BenchError(f"the server ended a stream with an error: {obj['error']}")
            usage = obj.get("usage") or usage
            if any(ch.get("text") for ch in obj.get("choices", ())):
                last = time.perf_counter()
                first = first or last
                chunks += 1
    tokens = int(usage.get("completion_tokens", chunks))
    tpot = (last - first) / (tokens - 1) if first is not None and last is not None and tokens > 1 else None
    return Sample(None if first is None else first - started, tpot, tokens, int(usage.get("prompt_tokens", 0)))


async def _one_whole(client: Any, body: dict[str, Any]) -> Sample:
    """A non-streamed request: its tokens from `usage`; no TTFT or TPOT to see."""
    r = await client.post("/v1/completions", json=body)
    if r.status_code != 200:
        raise BenchError(f"POST /v1/completions answered {r.status_code}: {r.text[:300]!r}")
    usage = r.json().get("usage") or {}
    return Sample(None, None, int(usage.get("completion_tokens", 0)), int(usage.get("prompt_tokens", 0)))
