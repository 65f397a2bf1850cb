"""`AsyncEngine`: an `Engine` on its own thread, streamed to asyncio callers (the server, the TUI).
Only the engine thread touches the engine; callers use a thread-safe inbox, outputs return on each
request's asyncio queue, and health is an immutable `EngineStats` snapshot per step. If the thread
dies, every waiting request gets `EngineDead` at once and new ones are refused."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from twinfer.runtime.constraints.spec import Constraint, GrammarError
from twinfer.runtime.engine.engine import Engine
from twinfer.runtime.engine.params import SamplingParams
from twinfer.runtime.engine.request import RequestOutput
from twinfer.runtime.errors import RequestError, TwinferError
from twinfer.runtime.vision import Image


class Overloaded(TwinferError):
    """The admission queue is full: retry after `retry_after_s` seconds (the server answers 429)."""

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ShuttingDown(TwinferError):
    """The engine is draining or stopped and takes no new requests (the server answers 503)."""


class EngineDead(TwinferError):
    """The engine thread failed; no request can finish (the server answers 500 / 503)."""


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's state, published by the engine thread after each step."""

    waiting: int = 0  # queued requests, the inbox included
    running: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    prefix_hit_rate: float = 0.0
    guard_trips: int = 0
    preemptions: int = 0
    steps: int = 0
    generated_tokens: int = 0
    speculative: dict[str, Any] = field(default_factory=dict)  # the speculator's counters, if any
    constraints: dict[str, float] = field(default_factory=dict)  # structured output (grammar) counters

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


def _deliver(loop: asyncio.AbstractEventLoop, items: list[tuple[_Stream, RequestOutput]],
             handed: threading.Event, passes: int = 3) -> None:
    """On the callers' loop: queue each output, then set `handed` after `passes` more loop turns."""
    if items:
        for stream, out in items:
            stream.queue.put_nowait(out)
    if passes == 0:
        handed.set()
    else:
        loop.call_soon(_deliver, loop, [], handed, passes - 1)


class _Stream:
    """The asyncio side of one request: a queue on the caller's loop, fed from the engine thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException | None] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException | None) -> None:
        """Thread-safe; None acknowledges that the engine accepted the request."""
        with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody is listening
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    priority: int
    stream: _Stream
    images: tuple[Image, ...] = ()
    arrived: float = field(default_factory=time.perf_counter)


@dataclass
class _Abort:
    request_id: str


class _Stop:
    pass


class RequestStream(AsyncIterator[RequestOutput]):
    """The deltas of one request; the last has `finished=True`. Closing it early aborts the request."""

    def __init__(self, owner: AsyncEngine, request_id: str, stream: _Stream):
        self.request_id = request_id
        self._owner = owner
        self._stream = stream
        self._done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._stream.queue.get()
        except BaseException:  # cancelled (client gone): the engine must stop working for it
            await self.aclose()
            raise
        if isinstance(item, BaseException):
            self._finish()
            raise item
        assert item is not None
        if item.finished:
            self._finish()
        return item

    def cancel(self) -> None:
        """Stop the request but keep the stream: its last output (finish_reason "abort") still comes."""
        if not self._done:
            self._owner.abort(self.request_id)

    async def aclose(self) -> None:
        """Abort the request if it is still running (idempotent)."""
        if not self._done:
            self._owner.abort(self.request_id)
            self._finish()

    def _finish(self) -> None:
        if not self._done:
            self._done = True
            self._owner._release_slot()


class AsyncEngine:
    """Runs `engine` on one background thread; asyncio callers submit, stream and abort requests.
    `max_queue`: requests allowed to wait beyond those running; past it `generate` raises `Overloaded`.
    `gather_s`: an idle engine keeps taking a burst's requests while they arrive less than this apart,
    so the burst prefills in one step (0: start at once; None: a tenth of the last idle start's cost per
    request, at most 50 ms, and only while the last start from idle had company: a lone client never
    waits). Methods run on one event loop; `abort` may be called from any thread."""

    GATHER_SPANS = 4
    GATHER_SHARE = 0.1  # gather_s=None: this share of the last step that started from idle ...
    GATHER_MAX_S = 0.05  # ... at most this

    def __init__(self, engine: Engine, max_queue: int = 64, name: str = "twinfer-engine",
                 gather_s: float | None = 0.0):
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        if gather_s is not None and gather_s < 0:
            raise ValueError(f"gather_s must be >= 0 or None, got {gather_s}")
        self.engine = engine
        self.max_queue = max_queue
        self.gather_s = gather_s
        self._idle_start_step_s = 0.0  # the runner's time in the last step from idle, over the requests it took
        self._gathered = 0  # requests the last inbox drain took
        self._idle_arrival: float | None = None  # when the request of the last start from idle arrived
        self._burst = True  # whether another request followed that one within the gathering span
        self.handoff_wait_s = 0.05  # the most a step waits for the loop to take the previous step's output
        self.max_running = engine.scheduler.config.max_seqs
        self.max_context = engine.max_context
        self.vocab_size = engine.runner.spec.vocab_size
        self._vision = engine.runner.vision  # expand() is pure: callers may run it on their own thread
        self._description = self._describe()  # read now: only the engine thread touches the runner later
        self._name = name
        self._inbox: queue.Queue[_Add | _Abort | _Stop] = queue.Queue()
        self._lock = threading.Lock()  # orders "submit" against "the thread died / stopped"
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._stopped = False
        self._accepting = True
        self._active = 0  # submitted and not yet finished, counted on the caller's loop
        self.stats = self._snapshot(pending=0)

    # -- lifecycle -----------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread (once)."""
        if self._thread is not None:
            raise RuntimeError("AsyncEngine.start() called twice")
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    async def shutdown(self, drain: bool = True, grace_s: float = 30.0) -> None:
        """Refuse new requests; with `drain`, let running ones finish for up to `grace_s`, then abort."""
        self._accepting = False
        if drain:
            await self.wait_idle(grace_s)
        with self._lock:
            if not self._stopped and self._error is None:
                self._inbox.put(_Stop())
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10.0)

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no request is active (True) or `timeout_s` passes (False)."""
        deadline = time.monotonic() + timeout_s
        while self._active > 0 and time.monotonic() < deadline and self.alive:
            await asyncio.sleep(0.02)
        return self._active == 0

    def stop_accepting(self) -> None:
        """New `generate` calls raise ShuttingDown from now on; running requests continue."""
        self._accepting = False

    # -- health --------------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._error is None

    @property
    def accepting(self) -> bool:
        return self._accepting and self.alive

    @property
    def error(self) -> BaseException | None:
        """Why the engine thread died, or None."""
        return self._error

    @property
    def active(self) -> int:
        """Requests submitted and not yet finished."""
        return self._active

    @property
    def queue_depth(self) -> int:
        return self.stats.waiting

    @property
    def running(self) -> int:
        return self.stats.running

    @property
    def kv_blocks_used(self) -> int:
        return self.stats.kv_blocks_used

    @property
    def kv_blocks_total(self) -> int:
        return self.stats.kv_blocks_total

    @property
    def prefix_hit_rate(self) -> float:
        return self.stats.prefix_hit_rate

    @property
    def guard_trips(self) -> int:
        return self.stats.guard_trips

    @property
    def reads_images(self) -> bool:
        """Whether the model has a vision tower (requests may carry images)."""
        return self._vision is not None

    def prompt_length(self, ids: Sequence[int], images: Sequence[Image]) -> int:
        """The prompt's length once its image markers expand (RequestError when they do not match)."""
        if not images:
            return len(ids)
        if self._vision is None:
            raise RequestError("this model reads no images: send text only")
        try:
            return len(self._vision.expand(list(ids), list(images))[0])
        except ValueError as e:
            raise RequestError(str(e)) from e

    # -- requests ------------------------------------------------------------------------------------
    async def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                       request_id: str | None = None, priority: int = 0, images: Sequence[Image] = ()
                       ) -> RequestStream:
        """Submit a request (`images` as `Engine.add_request` takes them); returns its stream once the
        engine has accepted it. Raises Overloaded,
        ShuttingDown, EngineDead or RequestError before any output is produced."""
        if self._error is not None:
            raise EngineDead(f"the engine stopped: {self._error!r}")
        if not self._accepting or self._thread is None:
            raise ShuttingDown("the server is shutting down and takes no new requests")
        if self._active >= self.max_running + self.max_queue:
            raise Overloaded(
                f"{self._active} requests are in flight (limit {self.max_running + self.max_queue}); retry later",
                retry_after_s=1.0,
            )
        if params is not None and params.constraint is not None:
            await self.compile(params.constraint)
        request_id = request_id or f"req-{uuid.uuid4().hex}"
        stream = _Stream(asyncio.get_running_loop())
        message = _Add(request_id, prompt if isinstance(prompt, str) else list(prompt),
                       params or SamplingParams(), priority, stream, tuple(images))
        with self._lock:
            if self._error is not None or self._stopped:
                raise EngineDead(f"the engine stopped: {self._error!r}")
            self._inbox.put(message)
        self._active += 1
        handle = RequestStream(self, request_id, stream)
        try:
            ack = await stream.queue.get()
        except BaseException:
            await handle.aclose()
            raise
        if isinstance(ack, BaseException):
            handle._finish()
            raise ack
        assert ack is None, "the engine thread acknowledges a request before its first output"
        return handle

    async def compile(self, constraint: Constraint) -> None:
        """Compile `constraint` on a worker thread within the grammar time limit (GrammarError if unusable)."""
        grammars = self.engine.grammars
        await asyncio.to_thread(grammars.ll_tokenizer)  # once per model; the limit is for the grammar
        try:
            await asyncio.wait_for(asyncio.to_thread(grammars.compile, constraint), grammars.time_limit_s)
        except asyncio.TimeoutError as e:
            raise GrammarError(grammars.too_slow(constraint)) from e

    def abort(self, request_id: str) -> None:
        """Stop a request and free its KV blocks (thread-safe; unknown ids are ignored)."""
        with self._lock:
            if not self._stopped and self._error is None:
                self._inbox.put(_Abort(request_id))

    def _release_slot(self) -> None:
        self._active -= 1

    # -- the engine thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        streams: dict[str, _Stream] = {}
        try:
            while True:
                idle = not self.engine.has_work
                if not self._drain_inbox(streams, block=idle):
                    break
                if self.engine.has_work:
                    computed_s = self.engine.metrics.step_seconds
                    outputs = self.engine.step()
                    if idle and self._gathered:  # what one request's start from idle costs
                        self._idle_start_step_s = (self.engine.metrics.step_seconds - computed_s) / self._gathered
                    handed = self._dispatch(outputs, streams)
                    if handed is not None:  # let the callers' loop write this step before computing the next
                        handed.wait(self.handoff_wait_s)
                self.stats = self._snapshot(self._inbox.qsize())
        except BaseException as exc:  # noqa: BLE001 - any failure must reach every waiting client
            self._die(exc, streams)
            return
        self._die(ShuttingDown("the engine was stopped"), streams, stopped=True)

    def gather_gap_s(self) -> float:
        """How long the engine thread waits for the next request of a burst that found it idle."""
        if self.gather_s is not None:
            return self.gather_s
        return self._auto_gap_s() if self._burst else 0.0

    def _auto_gap_s(self) -> float:
        return min(self.GATHER_MAX_S, self.GATHER_SHARE * self._idle_start_step_s)

    def _arrival(self, arrived: float, idle: bool) -> None:
        """Judge whether the last start from idle was a burst's: the next request came within the span."""
        if self._idle_arrival is not None:
            self._burst = arrived - self._idle_arrival <= self.GATHER_SPANS * self._auto_gap_s()
        self._idle_arrival = arrived if idle else None

    def _drain_inbox(self, streams: dict[str, _Stream], block: bool) -> bool:
        """Apply queued messages (False: stop); blocks for the first when idle, then gathers its burst."""
        gap = gather_until = 0.0  # set by the first request of a start from idle
        self._gathered = 0
        while True:
            wait = min(gap, gather_until - time.perf_counter()) if self._gathered < self.max_running else 0.0
            try:
                if block:
                    message = self._inbox.get(timeout=0.5)
                elif wait > 0:  # gathering a burst: take what arrives within `gather_s` of the last
                    message = self._inbox.get(timeout=wait)
                else:
                    message = self._inbox.get_nowait()
            except queue.Empty:
                if block:
                    continue
                return True
            if isinstance(message, _Add):
                self._arrival(message.arrived, idle=block)
            if block and isinstance(message, _Add):
                gap = self.gather_gap_s()  # judged with this arrival
                gather_until = time.perf_counter() + self.GATHER_SPANS * gap
            self._gathered += isinstance(message, _Add)
            block = False
            if isinstance(message, _Stop):
                for request_id in list(streams):  # what drain left: end it with finish_reason "abort"
                    out = self.engine.abort(request_id)
                    self._dispatch([out] if out is not None else [], streams)
                return False
            if isinstance(message, _Add):
                self._add(message, streams)
            else:
                out = self.engine.abort(message.request_id)
                if out is not None:
                    self._dispatch([out], streams)

    def _add(self, message: _Add, streams: dict[str, _Stream]) -> None:
        try:
            self.engine.add_request(message.prompt, message.params, request_id=message.request_id,
                                    priority=message.priority, images=message.images)
        except RequestError as exc:
            message.stream.put(exc)
            return
        streams[message.request_id] = message.stream
        message.stream.put(None)

    def _dispatch(self, outputs: list[RequestOutput], streams: dict[str, _Stream]) -> threading.Event | None:
        """Hand a step's outputs to their streams, one wake-up per event loop; returns the event the loop
        sets once the woken callers ran, which the engine thread waits on briefly so that loop work never
        preempts a compute thread mid-step (a spinning pool stalls at its next barrier)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, RequestOutput]]] = {}
        for out in outputs:
            stream = streams.get(out.request_id)
            if out.finished:
                streams.pop(out.request_id, None)
                self.engine.requests.pop(out.request_id, None)  # the engine keeps finished requests
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream, out))
        if not by_loop:
            return None
        handed = threading.Event()
        for loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody is listening
                loop.call_soon_threadsafe(_deliver, loop, items, handed)
        return handed

    def _die(self, exc: BaseException, streams: dict[str, _Stream], stopped: bool = False) -> None:
        """Fail every request that is waiting or still in the inbox; refuse new ones."""
        with self._lock:
            if stopped:
                self._stopped = True
            else:
                self._error = exc
            while True:
                try:
                    message = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if isinstance(message, _Add):
                    streams[message.request_id] = message.stream
        error = exc if stopped else EngineDead(f"the engine stopped: {exc!r}")
        for stream in streams.values():
            stream.put(error)
        streams.clear()

    def _snapshot(self, pending: int) -> EngineStats:
        e = self.engine
        return EngineStats(
            waiting=len(e.scheduler.waiting) + pending,
            running=len(e.scheduler.running),
            kv_blocks_used=e.blocks.num_used,
            kv_blocks_total=e.blocks.num_blocks,
            prefix_hit_rate=e.blocks.hit_rate(),
            guard_trips=e.metrics.guard_trips,
            preemptions=e.scheduler.preemptions,
            steps=e.metrics.steps,
            generated_tokens=e.metrics.generated_tokens,
            speculative=e.speculator.snapshot() if e.speculator is not None else {},
            constraints=e.grammars.stats.snapshot(),
        )

    def describe(self) -> dict[str, Any]:
        """Facts about the runner (backend, versions) for /health and bench records."""
        return dict(self._description)

    def _describe(self) -> dict[str, Any]:
        try:
            return dict(self.engine.runner.describe())
        except Exception:  # noqa: BLE001 - descriptive only
            return {"backend": getattr(self.engine.runner, "backend", "unknown")}
