"""`twinfer serve`: the OpenAI-compatible HTTP server for one model.

The port is bound first and answers /health with 503 while the model loads on a background thread;
SIGTERM (or Ctrl-C) drains: new requests get 503, in-flight ones finish within the grace period.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from twinfer.runtime.errors import TwinferError

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def run_serve(model: str | None, host: str, port: int, api_key: str | None, backend: str, max_seqs: int,
              ctx: int, threads: int | None, max_queue: int, served_model_name: str | None,
              drain_timeout: float, max_body_mb: float, log_level: str, loop_guard: bool = True,
              guard_retries: int = 0, speculate: str = "off",
              parallel: tuple[int, int, int] = (1, 1, 1), budget: tuple[str | None, bool] = (None, False),
              batch_invariant: bool = False, kv_events: str | None = None, replica_name: str | None = None,
              kv_connector: tuple[str | None, str] = (None, "127.0.0.1"), max_batch_tokens: int | None = None,
              kv_layout: str = "auto", batch_wait_ms: float | None = None, repetition_guard: str = "on") -> None:
    from twinfer.app import OpenOptions
    from twinfer.runtime.engine import GuardConfig
    from twinfer.server import create_app
    from twinfer.server.serve import make_server

    if max_seqs < 1 or ctx < 16 or max_queue < 0 or max_body_mb <= 0 or not 0 <= (batch_wait_ms or 0) <= 1000 or (
            max_batch_tokens is not None and max_batch_tokens < 1):
        raise TwinferError("--max-seqs must be >= 1, --ctx >= 16, --max-queue >= 0, --max-body-mb > 0, "
                           "--batch-wait-ms between 0 and 1000 and --max-batch-tokens >= 1")
    options = OpenOptions(model, backend, max_seqs=max_seqs, ctx=ctx, threads=threads, speculate=speculate,
                          parallel=parallel, memory_budget=budget[0], allow_pruning=budget[1],
                          batch_invariant=batch_invariant,  # a typo in --speculate or --kv-layout fails
                          kv_layout=kv_layout)  # before the port is bound
    if parallel != (1, 1, 1) and int(os.environ.get("RANK", "0")) > 0:  # a torchrun worker: no HTTP server
        from twinfer.app import open_session

        open_session(options)  # the worker serves its rank's steps inside, then exits
        return
    # No core is left to the HTTP event loop: the engine hands each step's output over and waits for the
    # loop to write it before computing the next step (AsyncEngine), so the loop never preempts a
    # compute thread mid-step, where a spinning pool (ggml, OpenMP) would stall at its next barrier.
    name = served_model_name or model_name(model)
    aliases = tuple(a for a in (model,) if a and a != name)
    if guard_retries < 0 or repetition_guard not in ("on", "off"):
        raise TwinferError("--guard-retries must be >= 0 and --repetition-guard on or off")
    guard = GuardConfig(enabled=loop_guard and repetition_guard == "on", retries=guard_retries)
    app = create_app(None, None, name, api_key=api_key or None, aliases=aliases,
                     max_body_bytes=int(max_body_mb * 1024 * 1024), guard=guard)
    state = app.state.twinfer
    server = make_server(app, host, port, grace_s=drain_timeout, log_level=log_level)
    if host not in LOOPBACK and not api_key:
        print(f"twinfer: warning: serving on {host} without --api-key: anyone who can reach it can use it",
              file=sys.stderr)

    def load() -> None:
        try:
            from twinfer.app import open_session
            from twinfer.runtime.engine.async_engine import AsyncEngine

            session = open_session(options)
            if session.strategy is not None:  # --memory-budget: the planner's local strategy, summarized on stderr
                print(f"twinfer: {session.strategy.summary()}", file=sys.stderr)
            opened, engine = session.opened, session.engine(replica=replica_name, max_batch_tokens=max_batch_tokens)
            if kv_connector[0]:  # prefill/decode disaggregation (runtime/kv/connector.py)
                from twinfer.app.pd import attach_kv_connector

                attach_kv_connector(engine, kv_connector[0], kv_connector[1])
            if kv_events:  # vLLM-format KV events for KV-aware routers (runtime/kv/events.py)
                from twinfer.runtime.kv.events import ZmqKVEventPublisher

                publisher.append(ZmqKVEventPublisher(kv_events, engine.blocks.block_size))
                engine.blocks.events = publisher[0]
            async_engine = AsyncEngine(engine, max_queue=max_queue, gather_s=None if batch_wait_ms is None else batch_wait_ms / 1000)
            async_engine.start()
            state.names.add(opened.name)
            state.attach(async_engine, opened.tokenizer)
            while not server.started and not server.should_exit:  # print the real port (--port 0)
                time.sleep(0.05)
            print(f"twinfer: serving {name!r} ({opened.runner.backend}, context {engine.max_context}{kv_note(opened.runner)}) "
                  f"on http://{host}:{server.port or port}/v1", file=sys.stderr)
        except Exception as e:  # noqa: BLE001 - reported as one line after the server stops
            state.load_error = str(e) if isinstance(e, TwinferError) else f"{type(e).__name__}: {e}"
            server.should_exit = True

    publisher: list[Any] = []  # the KV event publisher, once the engine exists
    threading.Thread(target=load, name="twinfer-load", daemon=True).start()
    server.run()
    for p in publisher:
        p.close()
    if state.load_error is not None:
        raise TwinferError(f"could not load the model: {state.load_error}")


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
