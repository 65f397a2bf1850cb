"""`twinfer cluster`: two replicas of the default GGUF model behind SGLang's Model Gateway, on loopback.

One cluster is started through the real command (`python -m twinfer.cli.main cluster --port 0`) for the
module; the tests run in file order: routing and health, KV events decoded with vLLM's own struct
definitions, a replica killed under load, then SIGTERM to the command and a check for orphans.
The KV event encoding and the block manager's hooks are also tested without processes.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

msgspec = pytest.importorskip("msgspec")
zmq = pytest.importorskip("zmq")
pytest.importorskip("msgpack")
pytest.importorskip("smg", reason="twinfer cluster runs SGLang's Model Gateway (pip install smg)")

from twinfer.app.cluster import ClusterConfig, Pools, free_port, gateway_command, http_status  # noqa: E402
from twinfer.runtime.errors import TwinferError  # noqa: E402
from twinfer.runtime.kv.block_manager import BlockManager, block_key  # noqa: E402
from twinfer.runtime.kv.events import EventBuffer, ZmqKVEventPublisher, external_hash  # noqa: E402

MODEL = "gemma-3-270m-q4_k_m"
REPO = Path(__file__).resolve().parent.parent


# -- vLLM's wire types (vllm/distributed/kv_events.py, the msgspec array_like form), to decode with -----------
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]  # type: ignore[assignment]


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)


# -- no processes ----------------------------------------------------------------------------------------------
def test_block_manager_events_follow_registration_and_eviction() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    sink = EventBuffer(block_size=2)
    bm.events = sink
    tokens = [1, 2, 3, 4, 5]
    bm.allocate(0, [], 5, tokens)
    bm.mark_computed(0, tokens, 5)  # two full blocks registered, chained: one merged BlockStored
    bm.free(0)
    events = sink.take()
    assert len(events) == 1 and events[0][0] == "BlockStored"
    stored = DECODER.decode(msgspec.msgpack.encode([0.0, events, 0])).events[0]
    assert isinstance(stored, BlockStored)
    assert stored.token_ids == [1, 2, 3, 4] and stored.block_size == 2 and stored.parent_block_hash is None
    k1 = block_key(bm.root, [1, 2])
    assert stored.block_hashes == [external_hash(k1), external_hash(block_key(k1, [3, 4]))]
    bm.allocate(1, [], 8, list(range(10, 18)))  # needs all 4 blocks: both cached blocks are evicted
    removed = sink.take()
    assert [e[0] for e in removed] == ["BlockRemoved"]
    assert sorted(removed[0][1]) == sorted(stored.block_hashes)
    bm.check()


def test_publisher_speaks_vllm_zmq_format() -> None:
    port = free_port()
    pub = ZmqKVEventPublisher(f"tcp://127.0.0.1:{port}", block_size=16, interval_s=0.01)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    try:
        time.sleep(0.3)  # a SUB joins late: wait for the connection before publishing
        pub.stored(b"k" * 32, None, list(range(16)))
        pub.stored(b"m" * 32, b"k" * 32, list(range(16, 32)))
        pub.removed(b"k" * 32)
        batches, seqs = [], []
        while sub.poll(2000):  # the start-up AllBlocksCleared (if this SUB joined in time), then ours
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"" and len(seq) == 8
            seqs.append(int.from_bytes(seq, "big"))
            batches.append(DECODER.decode(payload))
            if any(isinstance(e, BlockRemoved) for e in batches[-1].events):
                break
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
        batch = batches[-1]
        kinds = [type(e).__name__ for e in batch.events]
        assert kinds == ["BlockStored", "BlockRemoved"] and batch.data_parallel_rank == 0
        stored = batch.events[0]
        assert stored.block_hashes == [external_hash(b"k" * 32), external_hash(b"m" * 32)]
        assert stored.token_ids == list(range(32)) and stored.block_size == 16
    finally:
        sub.close(0)
        ctx.term()
        pub.close()


def test_config_refuses_bad_input_by_name() -> None:
    with pytest.raises(TwinferError, match="--policy"):
        ClusterConfig(policy="fastest")
    with pytest.raises(TwinferError, match="--prefill N and --decode M"):
        ClusterConfig(prefill=1)
    with pytest.raises(TwinferError, match="--replicas"):
        ClusterConfig(replicas=0)
    pd = gateway_command(ClusterConfig(prefill=1, decode=1), 9000, Pools(("http://p:1",), ("http://d:2",)))
    assert "--pd-disaggregation" in pd and pd[pd.index("--prefill") + 1] == "http://p:1"


# -- one cluster, through the command --------------------------------------------------------------------------
class RunningCluster:
    def __init__(self, proc: subprocess.Popen[bytes], url: str, replicas: list[dict[str, Any]], log: Path):
        self.proc, self.url, self.replicas, self.log = proc, url, replicas, log


def _post(url: str, body: dict[str, Any], timeout_s: float = 60.0) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:  # noqa: S310
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _metric(base: str, name: str) -> float:
    _, body = http_status(f"{base}/metrics")
    m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", body.decode(), re.M)
    assert m, f"{name} not on {base}/metrics"
    return float(m.group(1))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Any:
    logs = tmp_path_factory.mktemp("cluster")
    err = logs / "cluster.stderr"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    with open(err, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "twinfer.cli.main", "cluster", "--replicas", "2", "--port", "0",
                                 "--threads", "1", "--ctx", "2048", "--max-seqs", "4", "--log-dir", str(logs)],
                                env=env, stdout=out, stderr=out)
    deadline = time.monotonic() + 150
    text = ""
    while time.monotonic() < deadline and proc.poll() is None:
        text = err.read_text()
        if len(re.findall(r"replica \d+: ", text)) == 2:
            break
        time.sleep(0.25)
    else:
        proc.kill()
        pytest.fail(f"the cluster did not start within 150 s:\n{err.read_text()}")
    url = re.search(r"on (http://\S+)/v1", text).group(1)  # type: ignore[union-attr]
    replicas = [{"index": int(i), "url": u, "pid": int(p), "events": e}
                for i, u, p, e in re.findall(r"replica (\d+): (\S+) \(pid (\d+), KV events (\S+)\)", text)]
    running = RunningCluster(proc, url, replicas, err)
    yield running
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)
    for r in replicas:
        _kill_group(r["pid"])


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie nobody reaped yet counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_cluster_health_routes_and_load_metrics(cluster: RunningCluster) -> None:
    assert http_status(f"{cluster.url}/health")[0] == 200
    workers = json.loads(http_status(f"{cluster.url}/workers")[1])["workers"]
    assert sorted(w["url"] for w in workers) == sorted(r["url"] for r in cluster.replicas)
    assert all(w["is_healthy"] for w in workers)
    # cache_aware: the same long prompt twice goes to the replica that holds it, which reuses its prefix
    prompt = "The gateway routes this tenant's system prompt to one replica. " * 20
    first = _post(f"{cluster.url}/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2})
    second = _post(f"{cluster.url}/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2})
    assert first[0] == second[0] == 200
    assert first[1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second[1]["usage"]["prompt_tokens_details"]["cached_tokens"] >= first[1]["usage"]["prompt_tokens"] - 16
    chat = _post(f"{cluster.url}/v1/chat/completions",
                 {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 3})
    assert chat[0] == 200 and chat[1]["choices"][0]["message"]["role"] == "assistant"
    for r in cluster.replicas:
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                     "vllm:gpu_cache_usage_perc"):
            assert _metric(r["url"], name) >= 0.0


def test_kv_events_reach_a_zmq_subscriber_in_vllm_format(cluster: RunningCluster) -> None:
    target = cluster.replicas[0]
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(target["events"])
    try:
        time.sleep(0.5)
        ids = [(7 * i + 3) % 5000 + 1000 for i in range(40)]  # 40 token ids: two full 16-token blocks
        status, _ = _post(f"{target['url']}/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 1})
        assert status == 200
        stored: list[BlockStored] = []
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and sum(len(s.token_ids) for s in stored) < 32:
            if sub.poll(500):
                _, seq, payload = sub.recv_multipart()
                assert len(seq) == 8
                stored += [e for e in DECODER.decode(payload).events if isinstance(e, BlockStored)]
        tokens = [t for s in stored for t in s.token_ids]
        assert tokens[:32] == ids[:32], "the stored blocks hold the prompt's first two blocks, in order"
        assert all(s.block_size == 16 for s in stored)
        assert stored[0].parent_block_hash is None and len(stored[0].block_hashes) * 16 == len(stored[0].token_ids)
    finally:
        sub.close(0)
        ctx.term()


def _stream(url: str, prompt: str, max_tokens: int, out: dict[str, Any], timeout_s: float) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 1.0,
            "seed": 7}  # sampled: a greedy story may loop and stop early (the loop guard), before the kill
    req = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(), {"content-type": "application/json"})
    t0 = time.monotonic()
    chunks: list[str] = []
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:  # noqa: S310
            out["status"] = r.status
            for line in r:
                chunks.append(line.decode(errors="replace"))
                if out.get("first") is None and line.startswith(b"data: {"):
                    out["first"] = time.monotonic() - t0
    except urllib.error.HTTPError as e:
        out["status"] = e.code
    except Exception as e:  # noqa: BLE001 - a cut stream is an outcome the test inspects
        out["error"] = f"{type(e).__name__}: {e}"
    out["text"] = "".join(chunks)
    out["done"] = "data: [DONE]" in out["text"]
    out["elapsed"] = time.monotonic() - t0


def test_killed_replica_ends_streams_and_the_others_serve(cluster: RunningCluster) -> None:
    timeout_s = 60.0
    streams: list[dict[str, Any]] = [{} for _ in range(4)]
    threads = [threading.Thread(target=_stream, args=(cluster.url, f"Tenant {i} writes a long story: " * (2 + i),
                                                     160, streams[i], timeout_s)) for i in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    busy: list[dict[str, Any]] = []
    while time.monotonic() < deadline and not busy:  # the victim: a replica with a stream in flight
        busy = [r for r in cluster.replicas if _metric(r["url"], "twinfer_requests_running") >= 1]
        time.sleep(0.1)
    assert busy, "no stream reached a replica within 60 s"
    victim = busy[0]
    os.kill(victim["pid"], signal.SIGKILL)
    killed_at = time.monotonic()
    after = [_post(f"{cluster.url}/v1/completions", {"model": MODEL, "prompt": f"After the kill, request {i}.",
                                                     "max_tokens": 4}, timeout_s) for i in range(6)]
    for t in threads:
        t.join(timeout_s + 5)
    assert not any(t.is_alive() for t in threads), "a client waited past its timeout"
    assert [s for s, _ in after] == [200] * 6, f"requests admitted after the kill: {[s for s, _ in after]}"
    for s in streams:  # each stream either finishes or ends with the gateway's error event; none hangs
        finished = re.search(r'"finish_reason":"[a-z_]+"', s.get("text", "")) is not None
        s["cut"] = 'data: {"error"' in s.get("text", "") or "error" in s
        assert finished != s["cut"] and s["elapsed"] < timeout_s, s
    assert any(s["cut"] for s in streams), "no stream on the killed replica was cut"
    assert time.monotonic() - killed_at < timeout_s
    survivor = next(r["url"] for r in cluster.replicas if r is not victim)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _metric(survivor, "twinfer_requests_active") > 0:
        time.sleep(0.2)
    assert _metric(survivor, "twinfer_kv_blocks_used") == 0.0, "the survivor holds KV blocks after its requests"


def test_sigterm_stops_gateway_and_replicas_without_orphans(cluster: RunningCluster) -> None:
    children = [int(p) for p in subprocess.run(["pgrep", "-P", str(cluster.proc.pid)], capture_output=True,
                                                text=True).stdout.split()]
    assert len(children) >= 2  # the gateway and the surviving replica
    cluster.proc.send_signal(signal.SIGTERM)
    assert cluster.proc.wait(40) == 0
    deadline = time.monotonic() + 10
    pids = children + [r["pid"] for r in cluster.replicas]
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    assert not [p for p in pids if _alive(p)], "processes left after the cluster stopped"
