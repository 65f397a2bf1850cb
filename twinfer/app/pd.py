"""Prefill/decode disaggregation: the proxy that pairs a prefill replica with a decode replica.

vLLM's disaggregated-prefill proxy flow over twinfer's TCP transport (docs/cluster.md); `twinfer cluster
--prefill N --decode M` calls `start_pd_proxy` (or mounts `create_pd_app`)."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from twinfer.runtime.errors import TwinferError
from twinfer.runtime.kv.connector import KVConnector

GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions")


def attach_kv_connector(engine: Any, kind: str = "tcp", host: str = "127.0.0.1", timeout_s: float = 10.0,
                        ttl_s: float = 60.0) -> KVConnector:
    """Give an engine a KV connector over its runner's KV (`Runner.kv_port`), listening on `host`."""
    port = getattr(engine.runner, "kv_port", None)
    if port is None:
        raise TwinferError(f"this {engine.runner.backend} runner ({type(engine.runner).__name__}) cannot hand its "
                           "KV to another replica: the window-bounded and tensor-parallel torch runners keep no KV "
                           "port; serve with the plain torch, MLX or llama.cpp runner for --kv-connector")
    try:
        connector = KVConnector(port, kind, host, timeout_s=timeout_s, ttl_s=ttl_s)
    except OSError as e:
        raise TwinferError(f"the KV connector cannot listen on {host}: {e}") from e
    except ValueError as e:
        raise TwinferError(str(e)) from e
    engine.attach_connector(connector)
    return connector


class PDProxy:
    """Pairs prefill and decode replicas, round-robin over each pool. Thread-safe."""

    def __init__(self, prefill_urls: Sequence[str], decode_urls: Sequence[str], timeout_s: float = 600.0):
        if not prefill_urls or not decode_urls:
            raise TwinferError("prefill/decode serving needs at least one prefill and one decode replica URL")
        self.prefill_urls = [u.rstrip("/") for u in prefill_urls]
        self.decode_urls = [u.rstrip("/") for u in decode_urls]
        self.timeout_s = timeout_s
        self._prefill = itertools.cycle(range(len(self.prefill_urls)))
        self._decode = itertools.cycle(range(len(self.decode_urls)))
        self._lock = threading.Lock()

    def pick(self) -> tuple[str, str]:
        with self._lock:
            return self.prefill_urls[next(self._prefill)], self.decode_urls[next(self._decode)]

    @staticmethod
    def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
        """The request as the prefill replica gets it: one token, no stream, KV kept for a decoder."""
        out = {k: v for k, v in body.items() if k not in ("stream_options", "max_completion_tokens")}
        out.update(max_tokens=1, stream=False, n=1, kv_transfer_params={"do_remote_decode": True})
        return out


def create_pd_app(prefill_urls: Sequence[str], decode_urls: Sequence[str], timeout_s: float = 600.0) -> Any:
    """The proxy app: POST /v1/completions and /v1/chat/completions go prefill -> decode; GET /health,
    /v1/models answer from a decode replica. A replica that cannot be reached is a 502 naming it."""
    proxy = PDProxy(prefill_urls, decode_urls, timeout_s)
    app = FastAPI(title="twinfer prefill/decode proxy")
    app.state.pd = proxy
    client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0))

    def bad_gateway(url: str, e: Exception) -> JSONResponse:
        return JSONResponse({"error": {"message": f"the replica {url} could not be reached: {e}",
                                       "type": "server_error", "param": None, "code": "bad_gateway"}},
                            status_code=502)

    async def generation(request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return JSONResponse({"error": {"message": "the request body is not JSON", "type": "invalid_request_error",
                                           "param": None, "code": "invalid_json"}}, status_code=400)
        if not isinstance(body, dict):
            return JSONResponse({"error": {"message": "the request body must be a JSON object",
                                           "type": "invalid_request_error", "param": None, "code": None}},
                                status_code=400)
        route = request.url.path
        prefill, decode = proxy.pick()
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        prefill_cost = None
        if body.get("n", 1) == 1:  # n > 1: the decode replica computes the choices itself
            started = time.perf_counter()
            try:
                first = await client.post(prefill + route, json=PDProxy.prefill_body(body), headers=headers)
            except httpx.HTTPError as e:
                return bad_gateway(prefill, e)
            if first.status_code != 200:
                return Response(first.content, first.status_code, media_type="application/json")
            answer = first.json()
            params = answer.get("kv_transfer_params")
            if params:
                body = {**body, "kv_transfer_params": params}
            prefill_cost = {"replica": prefill, "wall_ms": (time.perf_counter() - started) * 1000.0,
                            **((answer.get("usage") or {}).get("cost") or {})}
        if body.get("stream"):
            return StreamingResponse(_stream(client, decode + route, body, headers), media_type="text/event-stream")
        try:
            second = await client.post(decode + route, json=body, headers=headers)
        except httpx.HTTPError as e:
            return bad_gateway(decode, e)
        if second.status_code != 200 or prefill_cost is None:
            return Response(second.content, second.status_code, media_type="application/json")
        out = second.json()
        cost = (out.get("usage") or {}).get("cost")
        if isinstance(cost, dict):
            cost["prefill"] = prefill_cost
        return JSONResponse(out)

    for route in GENERATION_ROUTES:
        app.add_api_route(route, generation, methods=["POST"])

    @app.get("/health")
    async def health() -> Response:
        codes = []
        for url in [*proxy.prefill_urls, *proxy.decode_urls]:
            try:
                codes.append((url, (await client.get(url + "/health")).status_code))
            except httpx.HTTPError:
                codes.append((url, 503))
        ok = all(code == 200 for _, code in codes)
        return JSONResponse({"status": "ok" if ok else "degraded", "replicas": dict(codes)},
                            status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models() -> Response:
        url = proxy.decode_urls[0]
        try:
            r = await client.get(url + "/v1/models")
        except httpx.HTTPError as e:
            return bad_gateway(url, e)
        return Response(r.content, r.status_code, media_type="application/json")

    return app


async def _stream(client: Any, url: str, body: dict[str, Any], headers: dict[str, str]) -> AsyncIterator[bytes]:
    try:
        async with client.stream("POST", url, json=body, headers=headers) as r:
            async for chunk in r.aiter_raw():
                yield chunk
    except httpx.HTTPError as e:
        yield (f'data: {{"error": {{"message": "the decode replica {url} failed: {e}", "type": "server_error", '
               f'"code": "bad_gateway"}}}}\n\ndata: [DONE]\n\n').encode()


class PDProxyServer:
    """The proxy served by uvicorn on a background thread; `url` once `start()` returns."""

    def __init__(self, app: Any, host: str, port: int):
        import uvicorn

        self.host = host
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off"))
        self._thread = threading.Thread(target=self.server.run, name="twinfer-pd-proxy", daemon=True)

    def start(self, timeout_s: float = 30.0) -> PDProxyServer:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise TwinferError("the prefill/decode proxy did not start")
            time.sleep(0.01)
        return self

    @property
    def port(self) -> int:
        for server in self.server.servers:
            for sock in server.sockets:
                return int(sock.getsockname()[1])
        raise TwinferError("the prefill/decode proxy is not listening")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout_s: float = 10.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout_s)


def start_pd_proxy(prefill_urls: Sequence[str], decode_urls: Sequence[str], host: str = "127.0.0.1",
                   port: int = 0, timeout_s: float = 600.0) -> PDProxyServer:
    """Serve the prefill/decode proxy on host:port (0: any free port) in this process; returns it started."""
    return PDProxyServer(create_pd_app(prefill_urls, decode_urls, timeout_s), host, port).start()
