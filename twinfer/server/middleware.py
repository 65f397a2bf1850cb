"""Plain ASGI middleware (request counting, API key, body-size limit), run before FastAPI reads
anything, so a rejected request costs a header check."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

from twinfer.server.errors import error_bytes

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


async def send_error(send: Send, status: int, message: str, type: str, code: str | None = None,
                     headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = error_bytes(message, type, None, code)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


class CountRequests:
    """Counts finished HTTP exchanges on /v1 routes by route and status (401/413 included)."""

    def __init__(self, app: ASGIApp, record: Callable[[str, int], None]):
        self.app = app
        self.record = record

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            self.record(path, status)


class RequireApiKey:
    """Every /v1 route needs `Authorization: Bearer <key>` (or Anthropic's `x-api-key: <key>`);
    compared in constant time."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("path", "").startswith("/v1"):
            headers = dict(scope.get("headers", []))
            given = headers.get(b"authorization", b"")
            if b"x-api-key" in headers:  # Anthropic's clients send the key in x-api-key
                given = b"Bearer " + headers[b"x-api-key"]
            if not hmac.compare_digest(given, self.expected):
                await send_error(send, 401, "missing or wrong API key: send the header 'Authorization: Bearer KEY'",
                                 "authentication_error", "invalid_api_key", [(b"www-authenticate", b"Bearer")])
                return
        await self.app(scope, receive, send)


class LimitBody:
    """Rejects request bodies over `max_bytes` with 413, by Content-Length or while reading (the body is
    read here, then replayed), so chunked uploads are bounded too."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers", [])).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            await self._too_large(send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._too_large(send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, send: Send) -> None:
        await send_error(send, 413, f"the request body is larger than {self.max_bytes} bytes",
                         "invalid_request_error", "request_too_large", [(b"connection", b"close")])
