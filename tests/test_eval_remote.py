"""`twinfer eval kl --candidate URL`: KL against an OpenAI-compatible endpoint, from its top-k logprobs.

A `twinfer serve` of the default GGUF must come out faithful (estimated mean KL <= 1e-3); a server of
its Q2_K requantization must come out within 20% of the KL `eval kl` measures locally between the two
files, and flagged. The echo path (prompt logprobs in one request) runs against a stub that computes
them with llama.cpp; bad endpoints (unreachable, no logprobs, another tokenizer, 429s) get one clear line.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("llama_cpp")
pytest.importorskip("openai")

from twinfer.app.models import open_model  # noqa: E402
from twinfer.app.runners import RUNNERS  # noqa: E402
from twinfer.quant.fidelity import RunnerSource  # noqa: E402
from twinfer.quant.kl import log_softmax  # noqa: E402
from twinfer.quant.remote import RemoteOptions, measure_remote_kl  # noqa: E402
from twinfer.runtime.engine import Engine, EngineConfig  # noqa: E402
from twinfer.runtime.engine.async_engine import AsyncEngine  # noqa: E402
from twinfer.runtime.errors import TwinferError  # noqa: E402
from twinfer.runtime.tokenizer import load_tokenizer  # noqa: E402
from twinfer.server import create_app  # noqa: E402
from twinfer.server.serve import ServerThread  # noqa: E402

TOKENS, WINDOW = 32, 33  # one window: BOS + 32 tokens, 32 scored rows
NAME = "gemma-3-270m-q4_k_m"


def serve(model: str | None, name: str, prefix_cache: bool) -> tuple[ServerThread, AsyncEngine]:
    o = open_model(model, "llamacpp", max_seqs=2, ctx=512, threads=1)
    config = EngineConfig(max_seqs=2, max_context=512, enable_prefix_cache=prefix_cache)
    engine = AsyncEngine(Engine(o.runner, o.tokenizer, config))
    engine.start()
    return ServerThread(create_app(engine, o.tokenizer, name)).start(), engine


@pytest.fixture
def served() -> Iterator[Callable[..., str]]:
    running: list[tuple[ServerThread, AsyncEngine]] = []

    def start(model: str | None, name: str, prefix_cache: bool = False) -> str:
        running.append(serve(model, name, prefix_cache))
        return running[-1][0].url + "/v1"

    yield start
    for st, engine in running:
        st.call(engine.shutdown(drain=False))
        st.stop()


def test_twinfer_serve_of_the_default_model_is_faithful(served: Callable[..., str]) -> None:
    url = served(None, NAME)
    report = measure_remote_kl(None, "llamacpp", url, "prose", TOKENS, WINDOW, runners=RUNNERS)
    assert report.kl.tokens == TOKENS
    assert report.kl.mean_kl <= 1e-3 and report.faithful, report
    assert report.kl.top1_agreement == 1.0
    assert report.method == "echo"  # twinfer serve returns prompt logprobs (the stub tests cover token-by-token)
    assert report.served_model == NAME and report.tokenizer_check == "/tokenize"
    assert report.candidate_tail_mass > 0 and report.seconds > 0


def test_twinfer_serve_with_prefix_cache_is_faithful(served: Callable[..., str]) -> None:
    """With the prefix cache on (the server's default) a token-by-token client gets prefix-cached KV
    continued in other chunk shapes (KL 0.0076 measured); one echo request computes the window whole."""
    url = served(None, NAME, prefix_cache=True)
    report = measure_remote_kl(None, "llamacpp", url, "prose", TOKENS, WINDOW, runners=RUNNERS)
    assert report.method == "echo" and report.kl.tokens == TOKENS
    # The logprobs are bit-identical (tests/test_prompt_logprobs.py). The tail-bucket bound then leaves
    # only float64 rounding (np.exp of an array vs of a scalar, ~1e-17); the tail model's estimate adds
    # p_tail * sigma^2 / 2 at the fit's smallest sigma (~1e-9).
    bound = report.bound if report.bound is not None else report.kl
    assert bound.mean_kl <= 1e-12 and report.kl.mean_kl <= 1e-6, report
    assert report.kl.top1_agreement == 1.0 and report.faithful, report


def _local_topk(candidate: str, k: int = 20) -> tuple[float, float]:
    """(exact KL, the top-k estimate `eval kl --candidate URL` makes) between two local llama.cpp runners
    on the test's window, the candidate truncated to its top k as an endpoint is."""
    from twinfer.quant.fidelity import corpus_windows
    from twinfer.quant.kl import kl_rows
    from twinfer.quant.topk_kl import topk_estimate_rows, truncate_top_k

    (w,) = corpus_windows(None, "prose", TOKENS, WINDOW)
    p = RunnerSource(open_model(None, "llamacpp", max_seqs=2, ctx=256).runner).logits(w)[:-1]
    q = RunnerSource(open_model(candidate, "llamacpp", max_seqs=2, ctx=256).runner).logits(w)[:-1]
    return float(kl_rows(p, q).mean()), float(topk_estimate_rows(p, truncate_top_k(q, k)).estimate.mean())


@pytest.fixture(scope="module")
def q2_k(default_model: Path) -> Path:
    from twinfer.backends.llamacpp.requantize import requantize_gguf

    return requantize_gguf(default_model, "q2_k", "MOSTLY_Q2_K")


@pytest.mark.slow
def test_q2_k_server_matches_local_estimate_and_is_flagged(served: Callable[..., str], q2_k: Path) -> None:
    """Against a server on the Q2_K requantization: within 20% of the exact KL between the two files, and flagged."""
    exact, local = _local_topk(str(q2_k))
    remote = measure_remote_kl(None, "llamacpp", served(str(q2_k), "q2"), "prose", TOKENS, WINDOW, runners=RUNNERS)
    assert exact > 0.05  # Q2_K of a 270M model is far from faithful
    assert abs(remote.kl.mean_kl - exact) <= 0.2 * exact, (remote.kl.mean_kl, exact)
    # the endpoint's top 20 are the local runner's; the token it adds to each (OpenAI's API returns the
    # sampled or prompt token's logprob too) is one exact term more in the sums
    assert remote.kl.mean_kl == pytest.approx(local, rel=0.02)
    assert remote.bound is not None and remote.bound.mean_kl <= exact * 1.01  # a lower bound on the exact KL
    assert remote.bound.mean_kl < remote.kl.mean_kl  # the tail model adds what the bucket misses
    assert not remote.faithful and any(line.strip().startswith("FLAGGED") for line in remote.lines())
    d = remote.as_dict()
    assert d["faithful"] is False and d["served_model"] == "q2" and d["bound"]["mean_kl"] == remote.bound.mean_kl


# -- stub endpoints ---------------------------------------------------------------------------------

class Stub:
    """A tiny OpenAI-shaped HTTP server; `routes` maps a path to (status, body, headers) per request body."""

    def __init__(self, routes: dict[str, Callable[[dict[str, Any]], tuple[int, dict[str, Any], dict[str, str]]]]):
        self.routes, self.hits = routes, 0
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, body: dict[str, Any]) -> None:
                stub.hits += 1
                route = stub.routes.get(self.path.split("?")[0])
                status, out, headers = route(body) if route else (404, {"error": {"message": "not found"}}, {})
                data = json.dumps(out).encode()
                self.send_response(status)
                for k, v in {"Content-Type": "application/json", **headers}.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802
                self._answer({})

            def do_POST(self) -> None:  # noqa: N802
                n = int(self.headers.get("Content-Length") or 0)
                self._answer(json.loads(self.rfile.read(n) or b"{}"))

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stub() -> Iterator[Callable[..., Stub]]:
    made: list[Stub] = []

    def make(routes: dict[str, Any]) -> Stub:
        made.append(Stub(routes))
        return made[-1]

    yield make
    for s in made:
        s.close()


def _models(_: dict[str, Any]) -> tuple[int, dict[str, Any], dict[str, str]]:
    return 200, {"object": "list", "data": [{"id": "stub", "object": "model", "created": 0, "owned_by": "t"}]}, {}


def _tokenize(shift: int = 0) -> Callable[[dict[str, Any]], tuple[int, dict[str, Any], dict[str, str]]]:
    tok = load_tokenizer(None)

    def answer(body: dict[str, Any]) -> tuple[int, dict[str, Any], dict[str, str]]:
        ids = tok.encode(body["prompt"], add_special_tokens=body.get("add_special_tokens", True))
        return 200, {"count": len(ids), "tokens": [i + shift if n == 5 else i for n, i in enumerate(ids)]}, {}

    return answer


def _completion(logprobs: dict[str, Any] | None) -> dict[str, Any]:
    return {"id": "c", "object": "text_completion", "created": 0, "model": "stub", "system_fingerprint": "fp-stub",
            "choices": [{"index": 0, "text": "x", "finish_reason": "length", "logprobs": logprobs}]}


@pytest.mark.parametrize("candidate", ["default", "q2_k"])
def test_echo_prompt_logprobs_are_used_where_the_endpoint_gives_them(stub: Callable[..., Stub], candidate: str,
                                                                     request: pytest.FixtureRequest) -> None:
    """A stub that computes prompt logprobs with llama.cpp: one request per window; the same file is
    faithful, its Q2_K requantization is flagged at the local top-20 estimate, below the exact KL."""
    tok = load_tokenizer(None)
    path = None if candidate == "default" else str(request.getfixturevalue("q2_k"))
    source = RunnerSource(open_model(path, "llamacpp", max_seqs=2, ctx=256, threads=1).runner)  # the stub's model
    calls: list[bool] = []

    def complete(body: dict[str, Any]) -> tuple[int, dict[str, Any], dict[str, str]]:
        calls.append(bool(body.get("echo")))
        ids, k = body["prompt"], body["logprobs"]
        lp = log_softmax(source.logits(ids))
        tops = [None] + [{tok.decode([int(i)]): float(row[i]) for i in np.argpartition(-row, k)[:k]} for row in lp[:-1]]
        return 200, _completion({"tokens": [], "token_logprobs": [], "top_logprobs": tops, "text_offset": []}), {}

    s = stub({"/v1/models": _models, "/tokenize": _tokenize(), "/v1/completions": complete})
    report = measure_remote_kl(None, "llamacpp", s.url, "prose", TOKENS, WINDOW, runners=RUNNERS)
    assert report.method == "echo" and calls == [True]  # the whole window in one request
    assert report.system_fingerprint == "fp-stub" and report.served_model == "stub"
    if path is None:
        assert report.kl.mean_kl <= 1e-6 and report.kl.top1_agreement == 1.0 and report.faithful
        return
    exact, local = _local_topk(path)
    assert report.kl.mean_kl == pytest.approx(local, rel=1e-3) and report.kl.mean_kl <= exact
    assert not report.faithful and report.lines()[-1].strip().startswith("FLAGGED")


def test_token_by_token_where_the_endpoint_refuses_echo(stub: Callable[..., Stub]) -> None:
    """An endpoint that refuses echo with logprobs (400) is scored one position per request, each prefix
    computed alone with llama.cpp: faithful, and 1 + 16 requests for one 17-token window."""
    tok = load_tokenizer(None)
    source = RunnerSource(open_model(None, "llamacpp", max_seqs=2, ctx=256, threads=1).runner)
    calls: list[bool] = []

    def complete(body: dict[str, Any]) -> tuple[int, dict[str, Any], dict[str, str]]:
        calls.append(bool(body.get("echo")))
        if body.get("echo"):
            return 400, {"error": {"message": "echo with logprobs is not supported", "param": "echo"}}, {}
        row = log_softmax(source.logits(body["prompt"]))[-1]
        top = {tok.decode([int(i)]): float(row[i]) for i in np.argsort(-row)[: body["logprobs"]]}
        return 200, _completion({"tokens": ["x"], "token_logprobs": [max(top.values())], "top_logprobs": [top],
                                 "text_offset": [0]}), {}

    s = stub({"/v1/models": _models, "/tokenize": _tokenize(), "/v1/completions": complete})
    report = measure_remote_kl(None, "llamacpp", s.url, "prose", 16, 17, runners=RUNNERS)
    assert report.method == "token-by-token" and calls == [True] + [False] * 16
    assert report.kl.mean_kl <= 1e-3 and report.kl.top1_agreement == 1.0 and report.faithful, report


def test_endpoint_without_logprobs_is_refused(stub: Callable[..., Stub]) -> None:
    s = stub({"/v1/models": _models, "/tokenize": _tokenize(),
              "/v1/completions": lambda body: (200, _completion(None), {})})
    with pytest.raises(TwinferError, match="returned no logprobs"):
        measure_remote_kl(None, "llamacpp", s.url, "prose", 16, 16, runners=RUNNERS)


def test_tokenizer_mismatch_is_refused_before_scoring(stub: Callable[..., Stub]) -> None:
    s = stub({"/v1/models": _models, "/tokenize": _tokenize(shift=1),
              "/v1/completions": lambda body: pytest.fail("scored despite another tokenizer")})
    with pytest.raises(TwinferError, match="tokenizer disagrees with the model's on the corpus at token 5"):
        measure_remote_kl(None, "llamacpp", s.url, "prose", 16, 16, runners=RUNNERS)


def test_429_is_retried_with_bounded_backoff_then_explained(stub: Callable[..., Stub]) -> None:
    s = stub({"/v1/models": lambda body: (429, {"error": {"message": "slow down"}}, {"retry-after-ms": "10"})})
    with pytest.raises(TwinferError, match=r"answered 429 \(rate limited\) 3 times"):
        measure_remote_kl(None, "llamacpp", s.url, "prose", 16, 16, runners=RUNNERS, options=RemoteOptions(retries=2))
    assert s.hits == 3


def test_cli_unreachable_url_is_one_line_not_a_traceback() -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    args = ["eval", "kl", "--reference", "llamacpp", "--candidate", f"http://127.0.0.1:{port}/v1", "--tokens", "16"]
    r = subprocess.run([sys.executable, "-c", "from twinfer.cli.main import main; main()", *args],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(f"twinfer: error: cannot reach http://127.0.0.1:{port}/v1")
