"""`twinfer serve`: the OpenAI-compatible HTTP server for one model.

The port is bound first and answers /health with 503 while the model loads on a background thread;
SIGTERM (or Ctrl-C) drains: new requests get 503, in-flight ones finish within the grace period."""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from twinfer.app import OpenOptions
from twinfer.runtime.errors import OptionError, TwinferError

LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class ServeOptions:
    """`twinfer serve`'s flags, checked when built (before the port is bound): the model to open (its
    limits are `OpenOptions`'), and how the HTTP server and its engine run."""

    open: OpenOptions
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_queue: int = 64  # requests that may wait beyond --max-seqs; past it, 429
    served_model_name: str | None = None
    drain_timeout: float = 30.0
    max_body_mb: float = 4.0
    log_level: str = "info"
    repetition_guard: str = "on"  # the loop guard's default; a request's repetition_guard overrides it
    loop_guard: bool = True  # --no-loop-guard: the same as --repetition-guard off
    guard_retries: int = 0
    kv_events: str | None = None  # a ZMQ address to publish vLLM-format KV events on
    replica_name: str | None = None
    kv_connector: str | None = None  # prefill/decode disaggregation: tcp or nixl
    kv_host: str = "127.0.0.1"
    max_batch_tokens: int | None = None
    batch_wait_ms: float | None = None
    fetch_image_urls: bool = False  # fetch http(s) image URLs (else only inline base64 images)
    max_images: int = 8  # image parts per request
    max_image_mb: float = 10.0  # one encoded image

    def __post_init__(self) -> None:
        checks = (
            ("max_images", self.max_images >= 1, f"need --max-images >= 1, got {self.max_images}"),
            ("max_image_mb", self.max_image_mb > 0, f"need --max-image-mb > 0, got {self.max_image_mb}"),
            ("max_queue", self.max_queue >= 0, f"need --max-queue >= 0, got {self.max_queue}"),
            ("max_body_mb", self.max_body_mb > 0, f"need --max-body-mb > 0, got {self.max_body_mb}"),
            ("batch_wait_ms", self.batch_wait_ms is None or 0 <= self.batch_wait_ms <= 1000,
             f"need --batch-wait-ms between 0 and 1000, got {self.batch_wait_ms}"),
            ("max_batch_tokens", self.max_batch_tokens is None or self.max_batch_tokens >= 1,
             f"need --max-batch-tokens >= 1, got {self.max_batch_tokens}"),
            ("guard_retries", self.guard_retries >= 0, f"need --guard-retries >= 0, got {self.guard_retries}"),
            ("repetition_guard", self.repetition_guard in ("on", "off"),
             f"need --repetition-guard on or off, got {self.repetition_guard!r}"),
        )
        for name, ok, message in checks:
            if not ok:
                raise OptionError(message, field=name)

    @property
    def name(self) -> str:
        """The model name clients send."""
        return self.served_model_name or model_name(self.open.model)


def run_serve(options: ServeOptions) -> None:
    from twinfer.runtime.engine import GuardConfig
    from twinfer.server import create_app
    from twinfer.server.images import ImageLimits
    from twinfer.server.serve import make_server

    o = options
    if o.open.parallel != (1, 1, 1) and int(os.environ.get("RANK", "0")) > 0:  # a torchrun worker: no HTTP server
        from twinfer.app import open_session

        open_session(o.open)  # the worker serves its rank's steps inside, then exits
        return
    # No core is left to the event loop: the engine waits for it to write each step's output, so the loop
    # never preempts a compute thread mid-step.
    aliases = tuple(a for a in (o.open.model,) if a and a != o.name)
    guard = GuardConfig(enabled=o.loop_guard and o.repetition_guard == "on", retries=o.guard_retries)
    images = ImageLimits(max_images=o.max_images, max_bytes=int(o.max_image_mb * 1024 * 1024),
                         fetch_urls=o.fetch_image_urls)
    app = create_app(None, None, o.name, api_key=o.api_key or None, aliases=aliases,
                     max_body_bytes=int(o.max_body_mb * 1024 * 1024), guard=guard, images=images)
    state = app.state.twinfer
    server = make_server(app, o.host, o.port, grace_s=o.drain_timeout, log_level=o.log_level)
    if o.host not in LOOPBACK and not o.api_key:
        print(f"twinfer: warning: serving on {o.host} without --api-key: anyone who can reach it can use it",
              file=sys.stderr)
    publisher: list[Any] = []  # the KV event publisher, once the engine exists
    threading.Thread(target=_load, args=(o, state, server, publisher), name="twinfer-load", daemon=True).start()
    server.run()
    for p in publisher:
        p.close()
    if state.load_error is not None:
        raise TwinferError(f"could not load the model: {state.load_error}")


def _load(o: ServeOptions, state: Any, server: Any, publisher: list[Any]) -> None:
    """Open the session and attach its engine to the server (on the load thread); a failure stops the server."""
    try:
        from twinfer.app import open_session
        from twinfer.runtime.engine.async_engine import AsyncEngine

        session = open_session(o.open)
        if session.strategy is not None:  # --memory-budget: the planner's local strategy, summarized on stderr
            print(f"twinfer: {session.strategy.summary()}", file=sys.stderr)
        opened, engine = session.opened, session.engine(replica=o.replica_name, max_batch_tokens=o.max_batch_tokens)
        if o.kv_connector:  # prefill/decode disaggregation (runtime/kv/connector.py)
            from twinfer.app.pd import attach_kv_connector

            attach_kv_connector(engine, o.kv_connector, o.kv_host)
        if o.kv_events:  # vLLM-format KV events for KV-aware routers (runtime/kv/events.py)
            from twinfer.runtime.kv.events import ZmqKVEventPublisher

            publisher.append(ZmqKVEventPublisher(o.kv_events, engine.blocks.block_size))
            engine.blocks.events = publisher[0]
        gather_s = None if o.batch_wait_ms is None else o.batch_wait_ms / 1000
        async_engine = AsyncEngine(engine, max_queue=o.max_queue, gather_s=gather_s)
        async_engine.start()
        state.names.add(opened.name)
        state.attach(async_engine, opened.tokenizer)
        while not server.started and not server.should_exit:  # print the real port (--port 0)
            time.sleep(0.05)
        print(f"twinfer: serving {o.name!r} ({opened.runner.backend}, context {engine.max_context}"
              f"{kv_note(opened.runner)}) on http://{o.host}:{server.port or o.port}/v1", file=sys.stderr)
    except Exception as e:  # noqa: BLE001 - reported as one line after the server stops
        state.load_error = str(e) if isinstance(e, TwinferError) else f"{type(e).__name__}: {e}"
        server.should_exit = True


def kv_note(runner: Any) -> str:
    """How a llama.cpp runner's KV cache is laid out, for the start-up line ('' for paged runners)."""
    kv = runner.kv
    if runner.backend != "llamacpp":
        return ""
    if kv.seq_tokens is None:
        return f", one KV cache of {kv.capacity_tokens:,} tokens for {kv.max_seqs} sequences"
    return f", a KV stream of {kv.seq_tokens:,} tokens for each of {kv.max_seqs} sequences"


def model_name(model: str | None) -> str:
    """The name clients use for the model: the file's stem or the folder's name."""
    if model is None:
        return "gemma-3-270m-q4_k_m"
    path = Path(model).expanduser()
    return path.stem if path.suffix == ".gguf" else path.name or str(model)
