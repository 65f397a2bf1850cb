"""Prefill/decode disaggregation over loopback: a prefill replica computes the prompt's KV, a decode
replica fetches it through the KV connector (runtime/kv/connector.py, TCP) and continues.

Each backend's replicas (a tiny random qwen3_moe on torch and MLX, the default GGUF on llama.cpp) run in
this process (two apps, two engines, two runners, the KV over TCP); the proxy (app/pd.py) pairs them.
Greedy text through the proxy must equal one server's; the transferred bytes must be the prompt's KV;
a KV that never arrives makes the decode replica recompute, and no KV block stays in use anywhere.
tests/test_kv_transfer_bytes.py holds the bytes to each runner's payload format at several lengths.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("torch")

from twinfer.app.models import open_model  # noqa: E402
from twinfer.app.pd import attach_kv_connector, start_pd_proxy  # noqa: E402
from twinfer.runtime.engine import Engine, EngineConfig, GuardConfig  # noqa: E402
from twinfer.runtime.engine.async_engine import AsyncEngine  # noqa: E402
from twinfer.runtime.kv.connector import KVConnector  # noqa: E402
from twinfer.server import create_app  # noqa: E402
from twinfer.server.serve import ServerThread  # noqa: E402

CTX, SEQS = 256, 4


def tiny_moe(folder: Path) -> str:
    """A random-weight qwen3_moe folder with a 96-token character tokenizer (no transformers needed)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from twinfer.runtime.synthetic import SyntheticMoE, write_synthetic_moe

    write_synthetic_moe(folder, SyntheticMoE(hidden=64, intermediate=32, layers=2, experts=4, top_k=2, vocab=96,
                                             heads=4, kv_heads=2, head_dim=16))
    tok = Tokenizer(models.WordLevel({chr(32 + i): i for i in range(95)} | {"<unk>": 95}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.save(str(folder / "tokenizer.json"))
    return str(folder)


class Replica:
    """One `twinfer serve`-like app on a thread: its engine, optionally with a KV connector."""

    def __init__(self, model: str | None, backend: str, name: str, connector: bool = True, timeout_s: float = 10.0):
        o = open_model(model, backend, max_seqs=SEQS, ctx=CTX, threads=1)
        self.runner = o.runner
        self.engine = Engine(o.runner, o.tokenizer, EngineConfig(max_seqs=SEQS, max_context=CTX, replica=name))
        self.connector: KVConnector | None = attach_kv_connector(self.engine, timeout_s=timeout_s) if connector else None
        self.async_engine = AsyncEngine(self.engine)
        self.async_engine.start()
        app = create_app(self.async_engine, o.tokenizer, "m", guard=GuardConfig(enabled=False))
        self.server = ServerThread(app).start()
        self.url = self.server.url

    def close(self) -> None:
        self.server.call(self.async_engine.shutdown(drain=False))
        self.server.stop()
        if self.connector is not None:
            self.connector.close()
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()


@pytest.fixture(scope="module", params=["torch", "llamacpp", "mlx"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    if request.param == "mlx":
        pytest.importorskip("mlx.core")
    if request.param == "llamacpp":
        pytest.importorskip("llama_cpp")
        model = None  # the embedded default GGUF
        prompt: Any = "The three primary colors are red, yellow and"
    else:
        model = tiny_moe(tmp_path_factory.mktemp("tiny-moe"))
        prompt = "a prompt of some forty characters, more or less"
    prefill = Replica(model, request.param, "prefill-0")
    decode = Replica(model, request.param, "decode-0")
    proxy = start_pd_proxy([prefill.url], [decode.url])
    try:
        yield {"backend": request.param, "prefill": prefill, "decode": decode, "proxy": proxy, "prompt": prompt}
    finally:
        proxy.stop()
        prefill.close()
        decode.close()


def _complete(url: str, prompt: Any, **extra: Any) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, **extra}
    r = httpx.post(url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return dict(r.json())


def _no_blocks_in_use(*replicas: Replica) -> None:
    for rep in replicas:
        rep.engine.blocks.check()
        assert rep.engine.blocks.num_used == 0, f"{rep.engine.config.replica} holds KV blocks after its requests"


def test_pd_greedy_equals_one_server_and_moves_the_prompts_kv(pair: dict[str, Any]) -> None:
    prefill, decode, proxy, prompt = pair["prefill"], pair["decode"], pair["proxy"], pair["prompt"]
    single = _complete(prefill.url, prompt)  # the prefill replica, asked plainly, is a single server
    pd = _complete(proxy.url, prompt)
    assert pd["choices"][0]["text"] == single["choices"][0]["text"]
    assert pd["usage"]["completion_tokens"] == single["usage"]["completion_tokens"] == 8
    cost = pd["usage"]["cost"]
    n = pd["usage"]["prompt_tokens"]
    kv_size = n * decode.runner.traffic.kv_bytes_per_token
    assert cost["bytes"]["kv_transferred"] == kv_size  # K and V of every layer at every prompt position
    # the rest of the wire: the payload's header, and llama.cpp's cell positions and per-layer headers
    overhead = cost["bytes"]["kv_transfer_overhead"]
    assert 0 < overhead <= (512 if pair["backend"] != "llamacpp" else 512 + 24 * n + 24 * decode.runner.spec.num_layers)
    assert cost["tokens"]["cached"]["remote"] == n and cost["tokens"]["computed"] == 0
    assert pd["usage"]["prompt_tokens_details"]["cached_tokens"] == n
    assert cost["route"]["replica"] == "decode-0"
    prefilled = cost["prefill"]["tokens"]
    assert cost["prefill"]["route"]["replica"] == "prefill-0"
    assert prefilled["computed"] + prefilled["cached"]["device"] == n  # the plain request left its blocks cached
    assert "kv_fallback" not in cost["route"]
    assert len(prefill.connector.store) == 0  # fetched, so nothing waits any longer
    _no_blocks_in_use(prefill, decode)


def test_pd_stream_through_the_proxy(pair: dict[str, Any]) -> None:
    prompt = pair["prompt"]
    single = _complete(pair["prefill"].url, prompt, max_tokens=6)
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    text, usage = "", None
    with httpx.stream("POST", pair["proxy"].url + "/v1/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        import json

        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                text += "".join(c.get("text", "") for c in chunk["choices"])
                usage = chunk.get("usage") or usage
    assert text == single["choices"][0]["text"]
    assert usage is not None and usage["cost"]["bytes"]["kv_transferred"] > 0


def test_kv_that_never_arrives_is_recomputed(pair: dict[str, Any]) -> None:
    """A decode replica whose KV source is gone, or answers nothing, recomputes within its timeout."""
    decode, prompt = pair["decode"], pair["prompt"]
    single = _complete(pair["prefill"].url, prompt)
    tokens = single["usage"]["prompt_tokens"]
    silent = socket.create_server(("127.0.0.1", 0))  # accepts, never answers
    held: list[socket.socket] = []
    threading.Thread(target=lambda: held.append(silent.accept()[0]), daemon=True).start()
    assert decode.connector is not None
    decode.connector.timeout_s = 1.0
    try:
        for port in (silent.getsockname()[1], _closed_port()):
            params = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": port,
                      "transfer_id": "nope", "num_tokens": tokens, "first_token_ids": [1]}
            out = _complete(decode.url, prompt, kv_transfer_params=params)
            assert out["choices"][0]["text"] == single["choices"][0]["text"]
            cost = out["usage"]["cost"]
            assert cost["bytes"]["kv_transferred"] == cost["bytes"]["kv_transfer_overhead"] == 0
            assert cost["tokens"]["computed"] + cost["tokens"]["cached"]["device"] == tokens
            assert cost["route"]["kv_fallback"]
    finally:
        decode.connector.timeout_s = 10.0
        silent.close()
        for s in held:
            s.close()
    _no_blocks_in_use(pair["prefill"], decode)


def _closed_port() -> int:
    s = socket.create_server(("127.0.0.1", 0))
    port = int(s.getsockname()[1])
    s.close()
    return port


def test_bad_kv_transfer_params_are_a_400(pair: dict[str, Any]) -> None:
    if pair["backend"] != "torch":
        pytest.skip("checked once")
    r = httpx.post(pair["decode"].url + "/v1/completions", timeout=60,
                   json={"prompt": "x", "max_tokens": 2, "kv_transfer_params": {"do_remote_prefill": True}})
    assert r.status_code == 400 and "remote_host" in r.json()["error"]["message"]
