"""KV hand-over between replicas (prefill/decode disaggregation), modeled on vLLM's KV connector.
`KVConnector` keeps vLLM's split and names: a scheduler side (`get_num_new_matched_tokens`,
`update_state_after_alloc`, `request_finished`) called on the engine's thread, and a worker side over
the runner's `KVPort` (`start_load_kv`, `wait_for_layer_load`, `save_kv_layer`, `wait_for_save`). A failed
or late fetch makes the request recompute. The flow: docs/architecture.md, "Prefill/decode
disaggregation"; docs/cluster.md. Nothing here touches a device."""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from twinfer.runtime.errors import RequestError

_LEN = struct.Struct("<Q")
MAX_PAYLOAD = 1 << 36  # 64 GiB: a sanity bound on the length prefix, not a policy


class KVPort(Protocol):
    """How one runner's KV leaves and enters its cache, layer by layer, called between steps: `table` is
    the block table, `num_tokens` the positions from 0. A whole-sequence serializer has one layer."""

    format: str  # what the bytes are: a runner and model fingerprint both ends must share

    def num_layers(self) -> int: ...

    def check(self) -> None:
        """ValueError, saying why, when this cache cannot be handed over (a TurboQuant-coded one)."""
        ...

    def kv_bytes(self, layer: int, data: bytes) -> int:
        """The K/V bytes in a layer's data; the rest is the runner's framing (cell positions, headers)."""
        ...

    def save_layer(self, layer: int, seq_id: int, table: list[int], num_tokens: int) -> bytes: ...

    def load_layer(self, layer: int, seq_id: int, table: list[int], num_tokens: int, data: bytes) -> None: ...


class PagedKVPort:
    """The torch and MLX ports over an `Ops` paged cache (dense K/V only): a layer's payload is K then V of
    positions [0, num_tokens) in order, independent of either side's blocks."""

    backend = ""

    def __init__(self, ops: Any):
        self.ops = ops
        spec = ops.spec
        self.format = (f"{self.backend}:{spec.name}:{ops.dtype}:{spec.num_layers}x{spec.num_kv_heads}x"
                       f"{spec.head_dim}:{'mla' if spec.mla is not None else 'mha'}")

    def num_layers(self) -> int:
        return int(self.ops.spec.num_layers)

    def kv_bytes(self, layer: int, data: bytes) -> int:
        return len(data)  # K and V rows alone, no framing

    def check(self) -> None:
        if self.ops.kv_quant:
            raise ValueError("a TurboQuant-coded KV cache cannot be handed to another replica; serve with dense KV")

    def positions(self, table: list[int], num_tokens: int) -> np.ndarray:
        """The cache slots of positions [0, num_tokens) under `table` (int64)."""
        bs = self.ops.block_size
        if len(table) * bs < num_tokens:
            raise ValueError(f"{len(table)} KV blocks cannot hold {num_tokens} positions")
        pos = np.arange(num_tokens)
        return np.asarray(table, dtype=np.int64)[pos // bs] * bs + pos % bs

    def check_size(self, layer: int, data: bytes, sizes: list[int], num_tokens: int) -> None:
        if sum(sizes) != len(data):
            raise ValueError(f"layer {layer}: {len(data)} bytes of KV, expected {sum(sizes)} for {num_tokens} positions")


@dataclass(frozen=True)
class KVTransferParams:
    """vLLM's `kv_transfer_params` request/response field, as twinfer reads and writes it."""

    do_remote_decode: bool = False  # to a prefill replica: compute the prompt, keep its KV for a decoder
    do_remote_prefill: bool = False  # to a decode replica: the prompt's KV waits at remote_host:remote_port
    remote_host: str | None = None
    remote_port: int | None = None
    transfer_id: str | None = None
    num_tokens: int = 0
    first_token_ids: tuple[int, ...] = ()

    @classmethod
    def parse(cls, raw: dict[str, Any] | None) -> KVTransferParams | None:
        """From a request body's field; RequestError naming the bad key."""
        if raw is None:
            return None
        if not isinstance(raw, dict):
            raise RequestError("kv_transfer_params must be an object")
        try:
            p = cls(bool(raw.get("do_remote_decode", False)), bool(raw.get("do_remote_prefill", False)),
                    raw.get("remote_host"), None if raw.get("remote_port") is None else int(raw["remote_port"]),
                    raw.get("transfer_id"), int(raw.get("num_tokens", 0)),
                    tuple(int(t) for t in raw.get("first_token_ids", ()) or ()))
        except (TypeError, ValueError) as e:
            raise RequestError(f"kv_transfer_params has a malformed value: {e}") from e
        if p.do_remote_prefill and not (p.remote_host and p.remote_port and p.transfer_id):
            raise RequestError("kv_transfer_params with do_remote_prefill needs remote_host, remote_port and transfer_id")
        if p.do_remote_prefill and not p.first_token_ids:
            raise RequestError("kv_transfer_params with do_remote_prefill needs first_token_ids (the prefill's token)")
        return p

    def as_dict(self) -> dict[str, Any]:
        return {"do_remote_decode": self.do_remote_decode, "do_remote_prefill": self.do_remote_prefill,
                "remote_host": self.remote_host, "remote_port": self.remote_port, "transfer_id": self.transfer_id,
                "num_tokens": self.num_tokens, "first_token_ids": list(self.first_token_ids)}


@dataclass
class KVPayload:
    """One sequence's KV in transit: a header (format, positions, layer sizes) and the layers' bytes."""

    format: str
    num_tokens: int
    layers: list[bytes]

    @property
    def nbytes(self) -> int:
        return sum(len(b) for b in self.layers)

    def encode(self) -> bytes:
        head = json.dumps({"format": self.format, "num_tokens": self.num_tokens,
                           "layers": [len(b) for b in self.layers]}).encode()
        return _LEN.pack(len(head)) + head + b"".join(self.layers)

    @classmethod
    def decode(cls, data: bytes) -> KVPayload:
        (n,) = _LEN.unpack_from(data)
        head = json.loads(data[_LEN.size : _LEN.size + n])
        if "error" in head:
            raise KeyError(head["error"])
        layers, at = [], _LEN.size + n
        for size in head["layers"]:
            layers.append(data[at : at + size])
            at += size
        if at != len(data):
            raise ValueError(f"KV payload is {len(data)} bytes, its header describes {at}")
        return cls(head["format"], int(head["num_tokens"]), layers)


class KVStore:
    """Payloads kept for a decoder to fetch, each until fetched or `ttl_s` old. Thread-safe."""

    def __init__(self, ttl_s: float):
        self.ttl_s = ttl_s
        self._items: dict[str, tuple[float, bytes]] = {}
        self._lock = threading.Lock()

    def put(self, key: str, data: bytes) -> None:
        with self._lock:
            self._expire()
            self._items[key] = (time.monotonic(), data)

    def take(self, key: str) -> bytes | None:
        with self._lock:
            self._expire()
            item = self._items.pop(key, None)
        return None if item is None else item[1]

    def __len__(self) -> int:
        with self._lock:
            self._expire()
            return len(self._items)

    def _expire(self) -> None:
        now = time.monotonic()
        for key in [k for k, (t, _) in self._items.items() if now - t > self.ttl_s]:
            del self._items[key]


class TcpTransport:
    """Serves a `KVStore` over TCP (length-prefixed id in, one encoded `KVPayload` out) and fetches from
    other replicas' stores. The port is the OS's choice unless given."""

    name = "tcp"

    def __init__(self, store: KVStore, host: str = "127.0.0.1", port: int = 0, advertise: str | None = None):
        self.store = store
        self._sock = socket.create_server((host, port))
        self.host = advertise or host
        self.port = int(self._sock.getsockname()[1])
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="twinfer-kv-tcp", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(30.0)
                key = _recv_exact(conn, _recv_len(conn, 4096)).decode()
                data = self.store.take(key)
                if data is None:
                    head = json.dumps({"error": f"no KV for transfer {key!r} (never stored, fetched, or expired)"})
                    data = _LEN.pack(len(head)) + head.encode()
                conn.sendall(_LEN.pack(len(data)) + data)
            except (OSError, ValueError, UnicodeDecodeError):
                return

    def fetch(self, host: str, port: int, key: str, timeout_s: float) -> bytes:
        """The payload stored under `key` at host:port; OSError/TimeoutError/KeyError when it cannot be had."""
        deadline = time.monotonic() + timeout_s
        with socket.create_connection((host, port), timeout=timeout_s) as conn:
            raw = key.encode()
            conn.sendall(_LEN.pack(len(raw)) + raw)
            conn.settimeout(max(0.01, deadline - time.monotonic()))
            return _recv_exact(conn, _recv_len(conn, MAX_PAYLOAD), deadline)

    def close(self) -> None:
        self._closed = True
        self._sock.close()


def _recv_len(conn: socket.socket, limit: int) -> int:
    (n,) = _LEN.unpack(_recv_exact(conn, _LEN.size))
    if n > limit:
        raise ValueError(f"length prefix {n} exceeds {limit}")
    return int(n)


def _recv_exact(conn: socket.socket, n: int, deadline: float | None = None) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the KV transfer ran out of time")
            conn.settimeout(left)
        chunk = conn.recv(min(1 << 20, n - len(buf)))
        if not chunk:
            raise ConnectionError(f"the KV peer closed the connection after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def make_transport(kind: str, store: KVStore, host: str = "127.0.0.1", port: int = 0) -> TcpTransport:
    """The transport named `kind`: "tcp" everywhere; "nixl" needs the `nixl` package (GPU RDMA)."""
    if kind == "tcp":
        return TcpTransport(store, host, port)
    if kind == "nixl":
        import importlib.util

        if importlib.util.find_spec("nixl") is None:
            raise RequestError("the nixl KV transport needs the `nixl` package (pip install nixl); use tcp")
        raise RequestError("nixl is installed, but twinfer hands KV over host memory only; use the tcp transport")
    raise RequestError(f"unknown KV transport {kind!r}: choose tcp or nixl")


@dataclass
class _Fetch:
    """A decode request's KV on its way (or arrived, or failed)."""

    params: KVTransferParams
    started: float = field(default_factory=time.perf_counter)
    done: threading.Event = field(default_factory=threading.Event)
    payload: KVPayload | None = None
    error: str | None = None
    seconds: float = 0.0
    wire_bytes: int = 0  # the payload as received, its length prefix included
    table: list[int] | None = None  # blocks allocated for it (update_state_after_alloc)


class KVConnector:
    """One replica's connector: stores KV for decoders (prefill role) and fetches it (decode role);
    `timeout_s` bounds a fetch, after which the request recomputes."""

    def __init__(self, port: KVPort, transport: str = "tcp", host: str = "127.0.0.1", listen_port: int = 0,
                 timeout_s: float = 10.0, ttl_s: float = 60.0):
        port.check()  # refused at start-up, not when the first prefill finishes
        self.port = port
        self.timeout_s = timeout_s
        self.store = KVStore(ttl_s)
        self.transport = make_transport(transport, self.store, host, listen_port)
        self._fetches: dict[str, _Fetch] = {}  # request id -> its fetch
        self._pending_loads: list[tuple[Any, _Fetch]] = []
        self.saved = self.loaded = self.failed = 0

    # -- requests entering ---------------------------------------------------------------------------
    def add_request(self, request: Any, params: KVTransferParams) -> None:
        """A decode request arrived: start fetching its KV now, in the background."""
        if not params.do_remote_prefill:
            return
        fetch = _Fetch(params)
        self._fetches[request.request_id] = fetch
        threading.Thread(target=self._fetch, args=(fetch, len(request.prompt)), daemon=True).start()

    def _fetch(self, fetch: _Fetch, prompt_len: int) -> None:
        p = fetch.params
        assert p.remote_host is not None and p.remote_port is not None and p.transfer_id is not None
        try:
            raw = self.transport.fetch(p.remote_host, p.remote_port, p.transfer_id, self.timeout_s)
            fetch.wire_bytes = _LEN.size + len(raw)
            payload = KVPayload.decode(raw)
            if payload.format != self.port.format:
                raise ValueError(f"the KV is in format {payload.format!r}, this replica runs {self.port.format!r}")
            if payload.num_tokens != prompt_len:
                raise ValueError(f"the KV holds {payload.num_tokens} positions, the prompt has {prompt_len} tokens")
            fetch.payload = payload
        except (OSError, ValueError, KeyError) as e:
            fetch.error = f"{type(e).__name__}: {e}"
        fetch.seconds = time.perf_counter() - fetch.started
        fetch.done.set()

    # -- scheduler side ------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int | None:
        """Prompt tokens the connector supplies beyond `num_computed_tokens`: None while the KV is on its
        way (the request waits), 0 when there is none (or it failed: the request recomputes)."""
        fetch = self._fetches.get(request.request_id)
        if fetch is None:
            return 0
        if not fetch.done.is_set():
            return None
        if fetch.payload is None or num_computed_tokens:
            self._fetches.pop(request.request_id, None)
            self.failed += fetch.payload is None
            request.bill.kv_transfer_s += fetch.seconds
            request.bill.extra["kv_fallback"] = fetch.error or "recomputed"
            return 0
        return fetch.payload.num_tokens

    def update_state_after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        """Blocks now hold room for the request's external tokens: load them at the next `start_load_kv`."""
        fetch = self._fetches.pop(request.request_id)
        fetch.table = list(block_ids)
        self._pending_loads.append((request, fetch))

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """A request ends. For a prefill done for a remote decoder, copy its prompt's KV out (its blocks
        may be freed at once: delay_free is False) and return where the decoder finds it."""
        self._fetches.pop(request.request_id, None)
        params = KVTransferParams.parse(request.params.kv_transfer_params)
        done = request.finish_reason not in (None, "abort") and request.num_computed >= len(request.prompt)
        if params is None or not params.do_remote_decode or not done or not request.output:
            return False, None
        n = len(request.prompt)
        try:
            layers = [self.save_kv_layer(i, request.seq_id, block_ids, n) for i in range(self.port.num_layers())]
        except ValueError as e:  # a recurrent state that ran past the prompt (more than one token generated)
            request.bill.extra["kv_fallback"] = f"save failed: {e}"
            return False, None
        self.wait_for_save()
        key = uuid.uuid4().hex
        self.store.put(key, KVPayload(self.port.format, n, layers).encode())
        self.saved += 1
        out = KVTransferParams(do_remote_prefill=True, remote_host=self.transport.host, remote_port=self.transport.port,
                               transfer_id=key, num_tokens=n, first_token_ids=tuple(request.output))
        return False, out.as_dict()

    # -- worker side ---------------------------------------------------------------------------------
    def start_load_kv(self, on_loaded: Callable[[Any, int, float, float], None]) -> list[Any]:
        """Write every pending request's KV into the runner; `on_loaded(request, tokens, kv_bytes, seconds)`
        per success. Returns the requests whose KV would not load (they recompute)."""
        failed = []
        pending, self._pending_loads = self._pending_loads, []
        for request, fetch in pending:
            payload = fetch.payload
            assert payload is not None and fetch.table is not None
            try:
                for layer, data in enumerate(payload.layers):
                    self.port.load_layer(layer, request.seq_id, fetch.table, payload.num_tokens, data)
                    self.wait_for_layer_load(layer)
            except ValueError as e:
                request.bill.extra["kv_fallback"] = f"load failed: {e}"
                self.failed += 1
                failed.append(request)
                continue
            self.loaded += 1
            kv = sum(self.port.kv_bytes(i, data) for i, data in enumerate(payload.layers))
            request.bill.kv_transfer_overhead += fetch.wire_bytes - kv
            on_loaded(request, payload.num_tokens, float(kv), fetch.seconds)
        return failed

    def wait_for_layer_load(self, layer: int) -> None:
        """Loads are synchronous here: a layer is in the cache when `load_layer` returns."""

    def save_kv_layer(self, layer: int, seq_id: int, block_ids: list[int], num_tokens: int) -> bytes:
        return self.port.save_layer(layer, seq_id, block_ids, num_tokens)

    def wait_for_save(self) -> None:
        """Saves are synchronous copies out of the cache: nothing is in flight when they return."""

    def waiting(self, request_id: str) -> bool:
        return request_id in self._fetches

    def idle_wait(self, timeout_s: float = 0.005) -> None:
        """Block briefly for a fetch in flight (the engine has nothing else to compute)."""
        pending = [f for f in self._fetches.values() if not f.done.is_set()]
        if pending:
            pending[0].done.wait(timeout_s)

    def close(self) -> None:
        self.transport.close()
