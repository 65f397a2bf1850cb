"""The OpenAI-compatible HTTP server (`twinfer serve`) and its HTTP load driver (`twinfer bench --url`).
FastAPI is imported only here, never by the engine: `from twinfer.server import create_app`."""

from twinfer.server.app import ServerState, create_app

__all__ = ["ServerState", "create_app"]
