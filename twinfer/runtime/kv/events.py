"""KV cache events in vLLM's wire format, so KV-aware routers (Dynamo, llm-d, SGLang's gateway) can follow a replica.
`ZmqKVEventPublisher` sends the block manager's `stored`/`removed` events as vLLM's `KVEventBatch` over
ZMQ PUB, with replay over an optional ROUTER socket; the wire format is in docs/cluster.md."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, Protocol

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class KVEventSink(Protocol):
    """Told by `BlockManager` (engine thread) of each block registered (`stored`, with its parent's key)
    and each registered block lost (`removed`). Must return quickly and never raise."""

    def stored(self, key: bytes, parent: bytes | None, tokens: Sequence[int]) -> None: ...

    def removed(self, key: bytes) -> None: ...


def external_hash(key: bytes) -> int:
    """A block key as the router sees it: its last 8 bytes, big-endian, unsigned (vLLM's int block hashes)."""
    return int.from_bytes(key[-8:], "big")


class EventBuffer:
    """Collects events as vLLM event arrays; a run of stored blocks that chain is merged into one event."""

    def __init__(self, block_size: int, max_events: int = 100_000):
        self.block_size = block_size
        self.max_events = max_events
        self._events: list[list[Any]] = []
        self._lock = threading.Lock()
        self.dropped = 0  # events lost to overflow (replaced by AllBlocksCleared)

    def stored(self, key: bytes, parent: bytes | None, tokens: Sequence[int]) -> None:
        h, p = external_hash(key), None if parent is None else external_hash(parent)
        with self._lock:
            last = self._events[-1] if self._events else None
            if last is not None and last[0] == "BlockStored" and p is not None and last[1][-1] == p:
                last[1].append(h)
                last[3].extend(tokens)
                return
            self._append(["BlockStored", [h], p, list(tokens), self.block_size, None, None, None])

    def removed(self, key: bytes) -> None:
        h = external_hash(key)
        with self._lock:
            last = self._events[-1] if self._events else None
            if last is not None and last[0] == "BlockRemoved":
                last[1].append(h)
                return
            self._append(["BlockRemoved", [h], None])

    def cleared(self) -> None:
        with self._lock:
            self._events = [["AllBlocksCleared"]]

    def take(self) -> list[list[Any]]:
        with self._lock:
            events, self._events = self._events, []
        return events

    def _append(self, event: list[Any]) -> None:
        if len(self._events) >= self.max_events:  # a subscriber that starts over is safe; one that misses a removal is not
            self.dropped += len(self._events)
            self._events = [["AllBlocksCleared"]]
        self._events.append(event)


def encode_batch(events: list[list[Any]], ts: float, dp_rank: int = 0) -> bytes:
    """The msgpack payload of one vLLM `KVEventBatch`."""
    import msgpack

    return bytes(msgpack.packb([ts, events, dp_rank], use_bin_type=True))


def decode_batch(payload: bytes) -> tuple[float, list[list[Any]], int | None]:
    """Inverse of `encode_batch`: (ts, events, data_parallel_rank)."""
    import msgpack

    batch = msgpack.unpackb(payload, raw=False)
    return batch[0], batch[1], batch[2] if len(batch) > 2 else None


class ZmqKVEventPublisher(EventBuffer):
    """Publishes the buffered events every `interval_s` on a ZMQ PUB socket bound to `endpoint`, starting
    with AllBlocksCleared so an earlier subscriber starts over."""

    def __init__(self, endpoint: str, block_size: int, *, replay_endpoint: str | None = None, topic: str = "",
                 interval_s: float = 0.02, buffer_steps: int = 10_000, dp_rank: int = 0):
        import zmq

        super().__init__(block_size)
        self.endpoint, self.topic, self.interval_s, self.dp_rank = endpoint, topic.encode(), interval_s, dp_rank
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self._replay = None
        try:
            self._pub.bind(endpoint)
            if replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ValueError(f"cannot bind the KV event socket {endpoint!r}: {e}") from e
        self._history: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        self.batches_sent = 0
        self._stop = threading.Event()
        self.cleared()
        self._thread = threading.Thread(target=self._run, name="twinfer-kv-events", daemon=True)
        self._thread.start()

    def close(self, timeout_s: float = 1.0) -> None:
        """Send what is buffered, stop the thread and close the sockets (idempotent)."""
        self._stop.set()
        self._thread.join(timeout_s)
        self._close_sockets()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._flush()
            self._serve_replay()
        self._flush()

    def _flush(self) -> None:
        events = self.take()
        if not events:
            return
        payload = encode_batch(events, time.time(), self.dp_rank)
        seq = self._seq.to_bytes(8, "big")
        try:
            self._pub.send_multipart((self.topic, seq, payload))
        except Exception:  # noqa: BLE001 - a closed socket at shutdown; the events are in the history
            return
        self._history.append((self._seq, payload))
        self._seq += 1
        self.batches_sent += 1

    def _serve_replay(self) -> None:
        import zmq

        if self._replay is None:
            return
        for _ in range(16):  # bounded: a flood of replay requests never starves publishing
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3:
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in list(self._history):
                if seq >= first:
                    self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((client, b"", END_SEQ, b""))

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(0)
        self._ctx.term()
