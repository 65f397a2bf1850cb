"""Running an app with uvicorn, with a graceful drain: the first SIGTERM/SIGINT keeps the port open
answering 503 while in-flight requests finish; a second signal exits at once."""

from __future__ import annotations

import asyncio
import signal
import socket
from types import FrameType
from typing import Any

import uvicorn

from twinfer.server.app import ServerState


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM/SIGINT drains the twinfer app before exiting."""

    def __init__(self, config: uvicorn.Config, state: ServerState, grace_s: float = 30.0):
        super().__init__(config)
        self.state = state
        self.grace_s = grace_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_task is not None or self._loop is None or sig not in (signal.SIGTERM, signal.SIGINT):
            self.should_exit = True
            self.force_exit = self._drain_task is not None
            return
        self._loop.call_soon_threadsafe(self.begin_drain)

    def begin_drain(self) -> None:
        """Start draining (idempotent); uvicorn exits when the drain is done. Call on the server's loop."""
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        try:
            await self.state.drain(self.grace_s)
        finally:
            self.should_exit = True

    @property
    def port(self) -> int | None:
        """The bound port (useful with port 0) once started."""
        for server in getattr(self, "servers", []):
            for sock in server.sockets:
                return int(sock.getsockname()[1])
        return None


def make_server(app: Any, host: str = "127.0.0.1", port: int = 8000, *, grace_s: float = 30.0,
                log_level: str = "info") -> DrainingServer:
    """A DrainingServer for a `create_app` app; call `.run()` (blocking) or `await .serve()`."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="off",
                            timeout_graceful_shutdown=5, access_log=log_level == "debug")
    return DrainingServer(config, app.state.twinfer, grace_s)


class ServerThread:
    """An app served by uvicorn on a background thread (tests, embedding in other programs).
    `port=0` lets the OS pick a free port; `url` is known once `start()` returns."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, grace_s: float = 30.0):
        import threading

        self.server = make_server(app, host, port, grace_s=grace_s, log_level="warning")
        self.host = host
        self._thread = threading.Thread(target=self.server.run, name="twinfer-uvicorn", daemon=True)

    def start(self, timeout_s: float = 30.0) -> ServerThread:
        import time

        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server thread did not start")
            time.sleep(0.01)
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.server.port}"

    def call(self, coro: Any, timeout_s: float | None = 60.0) -> Any:
        """Run a coroutine on the server's event loop and wait for its result."""
        assert self.server._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.server._loop).result(timeout_s)

    def drain(self) -> None:
        """Begin the SIGTERM drain without a signal."""
        assert self.server._loop is not None
        self.server._loop.call_soon_threadsafe(self.server.begin_drain)

    def stop(self, timeout_s: float = 10.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout_s)
