"""`twinfer cluster`: N `twinfer serve` replicas behind SGLang's Model Gateway (`smg`), on one port.
Replicas publish vLLM-format KV events and load gauges; each child runs in its own process group and
dies with this process, so stopping leaves no orphans; every wait is bounded. Prefill/decode pools go
to twinfer's proxy (app/pd.py) or the gateway's PD mode (docs/cluster.md)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import twinfer
from twinfer.runtime.errors import TwinferError

POLICIES = ("cache_aware", "round_robin", "power_of_two")


@dataclass(frozen=True)
class ClusterConfig:
    """What `twinfer cluster` runs. `replicas` for one pool; `prefill` + `decode` for two."""

    model: str | None = None
    replicas: int = 2
    prefill: int = 0
    decode: int = 0
    policy: str = "cache_aware"
    host: str = "127.0.0.1"
    port: int = 8000
    threads: int | None = None  # per replica; default: this machine's compute threads split among replicas
    ctx: int = 4096
    max_seqs: int = 16
    serve_args: tuple[str, ...] = ()  # passed to every `twinfer serve` as is
    kv_events: bool = True
    startup_timeout_s: float = 180.0
    stop_timeout_s: float = 15.0
    health_interval_s: float = 1.0  # how often the gateway probes each replica's /health
    log_dir: Path | None = None  # children's output goes to files here (default: this process's stderr)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise TwinferError(f"--policy must be one of {', '.join(POLICIES)}, not {self.policy!r}")
        if (self.prefill > 0) != (self.decode > 0) or self.prefill < 0 or self.decode < 0:
            raise TwinferError("give both --prefill N and --decode M (each >= 1) for disaggregated serving")
        if not self.disaggregated and not 1 <= self.replicas <= 64:
            raise TwinferError("--replicas must be between 1 and 64")
        if not 0 <= self.port <= 65535:
            raise TwinferError(f"--port {self.port} is not a TCP port")
        if self.startup_timeout_s <= 0 or self.stop_timeout_s <= 0:
            raise TwinferError("timeouts must be positive")

    @property
    def disaggregated(self) -> bool:
        return self.prefill > 0

    @property
    def num_replicas(self) -> int:
        return self.prefill + self.decode if self.disaggregated else self.replicas

    def replica_threads(self) -> int:
        if self.threads is not None:
            return self.threads
        from twinfer.runtime.cpu import default_threads

        return max(1, default_threads() // self.num_replicas)  # replicas share the cores, never oversubscribe


@dataclass
class Replica:
    """One `twinfer serve` child."""

    index: int
    role: str  # "replica", "prefill" or "decode"
    url: str
    kv_events: str | None
    proc: subprocess.Popen[bytes]

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None


@dataclass(frozen=True)
class Pools:
    """The replicas' base URLs by role: what a prefill/decode orchestrator (the gateway's PD mode) needs."""

    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    regular: tuple[str, ...] = ()


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct ports the OS says are free now (all bound at once, then released)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for sock in socks:
            sock.bind((host, 0))
        return [int(sock.getsockname()[1]) for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS says is free now (bound to 0 and released)."""
    return free_ports(1, host)[0]


def _child_setup() -> None:  # pragma: no cover - runs in the child between fork and exec
    os.setsid()  # a process group of its own: stop() signals the whole group
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: exit with us


def http_status(url: str, timeout_s: float = 2.0) -> tuple[int, bytes]:
    """(status, body) of a GET; 0 when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:  # noqa: S310 - loopback URLs we built
            return int(r.status), r.read()
    except urllib.error.HTTPError as e:
        try:
            return int(e.code), e.read()
        except OSError:  # the body timed out: the status is still the answer
            return int(e.code), b""
    except (OSError, ValueError):
        return 0, b""


def gateway_command(cfg: ClusterConfig, port: int, pools: Pools, metrics_port: int = 0) -> list[str]:
    """The `smg launch` command line for these pools (PD mode when there are prefill and decode URLs)."""
    argv = [sys.executable, "-m", "smg", "launch", "--host", cfg.host, "--port", str(port),
            "--health-check-endpoint", "/health",
            "--health-check-interval-secs", str(max(1, round(cfg.health_interval_s))),
            "--health-check-timeout-secs", "2", "--health-failure-threshold", "1",
            "--shutdown-grace-period-secs", "5", "--log-level", "warn",
            "--block-size", "16", "--disable-circuit-breaker",
            # its own metrics port would otherwise be a fixed 29000 on every address: two clusters would collide
            "--prometheus-host", cfg.host, "--prometheus-port", str(metrics_port or free_port(cfg.host))]
    if pools.prefill:
        argv += ["--pd-disaggregation", "--policy", cfg.policy]
        for url in pools.prefill:
            argv += ["--prefill", url]
        for url in pools.decode:
            argv += ["--decode", url]
    else:
        argv += ["--worker-urls", *pools.regular, "--policy", cfg.policy]
    return argv


class Cluster:
    """Starts the replicas and the gateway, watches them, stops them together. Use as a context manager."""

    def __init__(self, cfg: ClusterConfig):
        self.cfg = cfg
        self.replicas: list[Replica] = []
        self.gateway: subprocess.Popen[bytes] | None = None
        self.port = cfg.port
        self._logs: list[IO[bytes]] = []
        self._ports: list[int] = []  # free ports taken at start, all distinct
        self.pd_front: Any = None  # the prefill/decode proxy (in this process), when disaggregated
        self._stopped = threading.Event()

    # -- lifecycle ---------------------------------------------------------------------------------
    def __enter__(self) -> Cluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Start every replica, wait until each answers /health, then start the gateway and wait for it."""
        if self.replicas:
            raise TwinferError("this cluster is already started")
        if importlib.util.find_spec("smg") is None:
            raise TwinferError("twinfer cluster runs SGLang's Model Gateway: pip install smg")
        self._ports = free_ports(2 * self.cfg.num_replicas, self.cfg.host)
        try:
            self._start_replicas()
            self._wait(lambda: all(self._replica_ready(r) for r in self.replicas), "the replicas to load")
            if self.cfg.disaggregated:
                self._start_pd_front()
            else:
                self._start_gateway()
        except BaseException:
            self.stop()
            raise

    def _start_pd_front(self) -> None:
        """Hand the two pools' URLs to the prefill/decode orchestrator: twinfer's PD proxy (app/pd.py, which
        pairs a prefill and a decode replica per request over their KV connectors) where this build has it,
        else the gateway's own PD mode."""
        try:
            pd = importlib.import_module("twinfer.app.pd")
        except ImportError:
            self._start_gateway()
            return
        self.pd_front = pd.start_pd_proxy(self.pools.prefill, self.pools.decode, self.cfg.host, self.cfg.port)
        self.port = int(self.pd_front.port)

    def _start_gateway(self, attempts: int = 3) -> None:
        """Start smg on the asked port, or on a free one; a free port lost to a race is tried again, 3 times."""
        for attempt in range(attempts):
            gateway_port, metrics_port = free_ports(2, self.cfg.host)  # taken now, not before the health polls
            self.port = self.cfg.port or gateway_port
            self.gateway = self._spawn(gateway_command(self.cfg, self.port, self.pools, metrics_port), "gateway")
            try:
                self._wait(self._gateway_ready, "the gateway to route to every replica")
                return
            except TwinferError:
                if self.gateway.poll() is None or self.cfg.port or attempt == attempts - 1:
                    raise
                self.gateway = None  # it exited at once (a port taken since we looked): new ports

    def stop(self) -> None:
        """Stop the gateway, then the replicas (SIGTERM to each group; SIGKILL after `stop_timeout_s`)."""
        self._stopped.set()
        if self.pd_front is not None:
            self.pd_front.stop()
            self.pd_front = None
        procs = ([self.gateway] if self.gateway is not None else []) + [r.proc for r in self.replicas]
        for proc in procs:
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + self.cfg.stop_timeout_s
        for proc in procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(5.0)
            _signal_group(proc, signal.SIGKILL)  # anything the child left in its group
        for log in self._logs:
            log.close()
        self._logs.clear()

    def run(self, on_event: Callable[[str], None] = lambda msg: print(f"twinfer: {msg}", file=sys.stderr)) -> None:
        """Serve until SIGINT/SIGTERM or the gateway exits; say when a replica dies. Call from the main thread."""
        previous = {s: signal.signal(s, lambda *_: self._stopped.set()) for s in (signal.SIGINT, signal.SIGTERM)}
        dead: set[int] = set()
        try:
            while not self._stopped.wait(0.5):
                if self.gateway is not None and self.gateway.poll() is not None:
                    raise TwinferError(f"the gateway exited with status {self.gateway.returncode}")
                for r in self.replicas:
                    if not r.alive and r.index not in dead:
                        dead.add(r.index)
                        on_event(f"replica {r.index} ({r.url}) exited with status {r.proc.returncode}; "
                                 "the gateway routes to the others")
                if len(dead) == len(self.replicas):
                    raise TwinferError("every replica has exited")
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            on_event("stopping the gateway and the replicas")
            self.stop()

    # -- what it runs ------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://{self.cfg.host}:{self.port}"

    @property
    def pools(self) -> Pools:
        by_role: dict[str, tuple[str, ...]] = {}
        for role in ("prefill", "decode", "replica"):
            by_role[role] = tuple(r.url for r in self.replicas if r.role == role)
        return Pools(prefill=by_role["prefill"], decode=by_role["decode"], regular=by_role["replica"])

    def _start_replicas(self) -> None:
        cfg = self.cfg
        roles = (["prefill"] * cfg.prefill + ["decode"] * cfg.decode) if cfg.disaggregated else ["replica"] * cfg.replicas
        threads = cfg.replica_threads()
        for i, role in enumerate(roles):
            port, events_port = self._ports.pop(), self._ports.pop()
            events = f"tcp://{cfg.host}:{events_port}" if cfg.kv_events else None
            argv = [sys.executable, "-m", "twinfer.cli.main", "serve", *([cfg.model] if cfg.model else []),
                    "--host", cfg.host, "--port", str(port), "--threads", str(threads), "--ctx", str(cfg.ctx),
                    "--max-seqs", str(cfg.max_seqs), "--log-level", "warning",
                    *(["--kv-connector", "tcp"] if role != "replica" else []),
                    *(["--kv-events", events] if events else []), *cfg.serve_args]
            proc = self._spawn(argv, f"replica-{i}")
            self.replicas.append(Replica(i, role, f"http://{cfg.host}:{port}", events, proc))

    def _spawn(self, argv: Sequence[str], name: str) -> subprocess.Popen[bytes]:
        env = dict(os.environ)
        root = str(Path(twinfer.__file__).resolve().parent.parent)  # the children import this very twinfer
        env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
        out: IO[bytes] | None = None
        if self.cfg.log_dir is not None:
            self.cfg.log_dir.mkdir(parents=True, exist_ok=True)
            out = open(self.cfg.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - closed in stop()
            self._logs.append(out)
        return subprocess.Popen(list(argv), env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                preexec_fn=_child_setup)  # noqa: PLW1509 - setsid + parent-death signal only

    # -- readiness ---------------------------------------------------------------------------------
    def _replica_ready(self, r: Replica) -> bool:
        if not r.alive:
            raise TwinferError(f"replica {r.index} exited with status {r.proc.returncode} while loading"
                               + (f" (see {self.cfg.log_dir}/replica-{r.index}.log)" if self.cfg.log_dir else ""))
        return http_status(f"{r.url}/health", 1.0)[0] == 200

    def _gateway_ready(self) -> bool:
        assert self.gateway is not None
        if self.gateway.poll() is not None:
            raise TwinferError(f"the gateway exited with status {self.gateway.returncode} while starting"
                               + (f" (see {self.cfg.log_dir}/gateway.log)" if self.cfg.log_dir else ""))
        status, body = http_status(f"{self.url}/workers", 1.0)
        if status != 200:
            return False
        import json

        try:
            workers: Any = json.loads(body)
        except ValueError:
            return False
        listed = workers.get("workers", []) if isinstance(workers, dict) else []
        healthy = [w for w in listed if isinstance(w, dict) and w.get("is_healthy", True)]
        return len(healthy) >= len(self.replicas)

    def _wait(self, ready: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        while not ready():
            if time.monotonic() > deadline:
                raise TwinferError(f"timed out after {self.cfg.startup_timeout_s:.0f} s waiting for {what}")
            if self._stopped.wait(0.25):
                raise TwinferError(f"stopped while waiting for {what}")


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def describe(cluster: Cluster) -> list[str]:
    """Lines saying what runs where (printed by the CLI once the cluster is up)."""
    front = "prefill/decode proxy" if cluster.pd_front is not None else f"gateway (smg, policy {cluster.cfg.policy})"
    lines = [f"{front} on {cluster.url}/v1"]
    for r in cluster.replicas:
        events = f", KV events {r.kv_events}" if r.kv_events else ""
        lines.append(f"  {r.role} {r.index}: {r.url} (pid {r.proc.pid}{events})")
    return lines


__all__ = ["POLICIES", "Cluster", "ClusterConfig", "Pools", "Replica", "describe", "free_port", "free_ports",
           "gateway_command"]
