"""`create_app`: the OpenAI-compatible HTTP server over an `AsyncEngine`, one model per app.
Routes: docs/api.md. No global state: metrics, engine and drain state live on `app.state.twinfer`, so two
apps can share one process. Outer layers, in order: request counting, the API key, the body-size limit."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from twinfer.runtime.constraints.spec import GrammarError
from twinfer.runtime.engine.async_engine import AsyncEngine
from twinfer.runtime.engine.params import GuardConfig
from twinfer.server import anthropic, handlers, responses_api, tokens
from twinfer.server.errors import APIError, from_validation
from twinfer.server.images import ImageLimits
from twinfer.server.metrics import CONTENT_TYPE, ServerMetrics
from twinfer.server.middleware import CountRequests, LimitBody, RequireApiKey
from twinfer.server.protocol import ChatCompletionRequest, CompletionRequest
from twinfer.server.tokens import DetokenizeRequest, TokenizeRequest

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024


class ServerState:
    """What one app serves and whether it can: the engine (None while loading), drain state, metrics."""

    def __init__(self, engine: AsyncEngine | None, tokenizer: Any, model_name: str, aliases: tuple[str, ...],
                 guard: GuardConfig, images: ImageLimits | None = None):
        self.engine = engine
        self.images = images or ImageLimits()  # what image parts may be (server/images.py)
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.names = {model_name, *aliases}
        self.guard = guard
        self.draining = False
        self.load_error: str | None = None
        self.created = int(time.time())
        self.metrics = ServerMetrics(lambda: self.engine)

    def attach(self, engine: AsyncEngine, tokenizer: Any) -> None:
        """Start serving `engine` (a server that was started while its model loaded). llguidance's
        tokenizer is built first: the build holds the GIL for seconds on a 262k vocabulary, which
        would freeze every stream if the first constrained request paid for it."""
        with contextlib.suppress(GrammarError):  # unreadable: the first constrained request says so (400)
            engine.engine.grammars.ll_tokenizer()
        self.tokenizer = tokenizer
        self.engine = engine

    def ready(self) -> tuple[AsyncEngine, Any]:
        """The engine and tokenizer, or the 503 that says why there are none."""
        if self.draining:
            raise APIError(503, "the server is shutting down and takes no new requests", "server_error",
                           code="shutting_down")
        engine = self.engine
        if engine is None:
            raise APIError(503, "the model is still loading; retry shortly", "server_error", code="loading",
                           headers={"Retry-After": "2"})
        if not engine.alive:
            raise APIError(503, f"the engine is not running: {engine.error!r}", "server_error", code="engine_failed")
        return engine, self.tokenizer

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.names:
            raise APIError(404, f"the model {name!r} does not exist here; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    async def drain(self, grace_s: float) -> None:
        """Refuse new requests (503) and let in-flight ones finish for up to `grace_s` seconds; what is
        left then ends with finish_reason "abort" and a shutdown error. Stops the engine thread."""
        self.draining = True
        if self.engine is not None:
            self.engine.stop_accepting()
            await self.engine.shutdown(drain=True, grace_s=grace_s)

    def health(self) -> tuple[int, dict[str, Any]]:
        engine = self.engine
        if self.load_error is not None:
            return 503, {"status": "failed", "error": self.load_error}
        if engine is None:
            return 503, {"status": "loading"}
        if self.draining:
            return 503, {"status": "draining", "active": engine.active}
        if not engine.alive:
            return 503, {"status": "failed", "error": repr(engine.error)}
        s = engine.stats
        return 200, {"status": "ok", "model": self.model_name, "build": engine.describe(), "waiting": s.waiting,
                     "running": s.running, "kv_usage": round(s.kv_usage, 4), "max_context": engine.max_context}


def create_app(async_engine: AsyncEngine | None, tokenizer: Any, model_name: str, api_key: str | None = None, *,
               aliases: tuple[str, ...] = (), max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               guard: GuardConfig | None = None, images: ImageLimits | None = None) -> FastAPI:
    """The server app. `async_engine` may be None while the model loads (`state.attach` it later);
    the caller starts and stops the engine. `guard` is the loop guard applied to every request; `images`
    what image parts it accepts."""
    state = ServerState(async_engine, tokenizer, model_name, aliases, guard or GuardConfig(), images)
    app = FastAPI(title="twinfer", summary="OpenAI-compatible inference server", version="1")
    app.state.twinfer = state

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        err = from_validation(exc.errors())
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        messages = {404: f"no route {request.method} {request.url.path}",
                    405: f"{request.method} is not allowed on {request.url.path}",
                    400: "the request body cannot be parsed: send UTF-8 JSON, nested at most a few hundred levels"}
        codes = {404: "not_found", 405: "method_not_allowed", 400: "invalid_json"}
        err = APIError(exc.status_code, messages.get(exc.status_code, str(exc.detail)),
                       code=codes.get(exc.status_code))
        return JSONResponse(err.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def crashed(_: Request, exc: Exception) -> JSONResponse:
        err = APIError(500, f"internal error ({type(exc).__name__}); this is a twinfer bug", "server_error")
        return JSONResponse(err.body(), status_code=500)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await handlers.generation(state, request, body)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await handlers.generation(state, request, body)

    _more_routes(app, state)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        max_len = state.engine.max_context if state.engine is not None else None
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                            "owned_by": "twinfer", "max_model_len": max_len}]}

    @app.get("/health")
    async def health() -> JSONResponse:
        status, body = state.health()
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def metrics() -> Response:
        data = await asyncio.to_thread(state.metrics.render)
        return Response(data, media_type=CONTENT_TYPE)

    app.add_middleware(LimitBody, max_bytes=max_body_bytes)
    if api_key:
        app.add_middleware(RequireApiKey, api_key=api_key)
    app.add_middleware(CountRequests, record=state.metrics.record_http)
    return app


def _more_routes(app: FastAPI, state: ServerState) -> None:
    """Anthropic's Messages API, OpenAI's Responses API and vLLM's tokenizer routes."""

    @app.post("/v1/messages")
    async def anthropic_messages(body: anthropic.MessagesRequest, request: Request) -> Response:
        return await anthropic.messages(state, request, body)

    @app.post("/v1/messages/count_tokens")
    async def anthropic_count_tokens(body: anthropic.CountTokensRequest) -> dict[str, Any]:
        return await anthropic.count_tokens(state, body)

    @app.post("/v1/responses")
    async def responses(body: responses_api.ResponsesRequest, request: Request) -> Response:
        return await responses_api.create(state, request, body)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        return await tokens.tokenize(state, body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        return await tokens.detokenize(state, body)
