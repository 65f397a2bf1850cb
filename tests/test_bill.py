"""The bill of every request (engine/bill.py, kv/traffic.py): times that add up to the request's wall
time, token counts by tier, and bytes from the runner's per-step accounting that agree with the
planner's per-token figures on the default model; the same figures in every API's usage and in
/metrics.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from twinfer.runtime.batch import SeqChunk, StepBatch
from twinfer.runtime.engine.bill import Bill, charge_step, merge_costs
from twinfer.runtime.engine.params import GuardConfig
from twinfer.runtime.kv.traffic import StepTraffic

PHASES = ("queue", "kv_transfer", "prefill", "decode", "spec_verify")


def test_step_traffic_counts_windows_and_experts() -> None:
    t = StepTraffic(1000.0, (10.0, 10.0), (None, 4), expert_bytes=7.0, num_experts=8, top_k=2, moe_layers=2)
    batch = StepBatch([SeqChunk(0, [1, 2, 3], 0), SeqChunk(1, [5], 9)])
    step = t.step(batch)
    assert step.weights_read == 1000.0
    assert step.experts_read == 7.0 * 2 * min(8, 4 * 2)
    # prefill of 3 at 0: full layer reads 3 positions, the window-4 layer min(3, 4 + 3 - 1); decode at 9 -> 10
    assert step.kv_read == (10.0 * 3 + 10.0 * 3, 10.0 * 10 + 10.0 * 4)
    assert step.kv_written == (20.0 * 3, 20.0 * 1)


def test_charge_shares_weights_by_tokens_and_keeps_kv_per_chunk() -> None:
    bills = [Bill(), Bill()]
    t = StepTraffic(400.0, (1.0,), (None,))
    charge_step(bills, [3, 1], t.step(StepBatch([SeqChunk(0, [1, 2, 3], 0), SeqChunk(1, [4], 5)])))
    assert (bills[0].weights_read, bills[1].weights_read) == (300.0, 100.0)
    assert (bills[0].kv_read, bills[1].kv_read) == (3.0, 6.0)
    assert (bills[0].kv_written, bills[1].kv_written) == (3.0, 1.0)


def test_bill_times_partition_the_wall_time() -> None:
    bill = Bill(kv_transfer_s=0.5, spec_verify_s=1.0)
    cost = bill.as_dict(arrival=10.0, scheduled=11.0, first_token=12.5, finished=15.0, prompt=5, output=4)
    t = cost["time_ms"]
    assert t == pytest.approx({"queue": 500.0, "kv_transfer": 500.0, "prefill": 1500.0, "decode": 1500.0,
                               "spec_verify": 1000.0, "total": 5000.0})
    assert merge_costs([cost, cost])["tokens"]["output"] == 8


def test_torch_bill_with_speculation(tmp_path: Any) -> None:
    """The torch runner's traffic: its cache's exact KV bytes, experts apart; drafted decodes bill their verification."""
    pytest.importorskip("torch")
    from twinfer.backends.cuda.runner import build_torch_runner
    from twinfer.runtime.engine import Engine, EngineConfig, SamplingParams
    from twinfer.runtime.loaders import load_model
    from twinfer.runtime.speculative.ngram import NgramProposer
    from twinfer.runtime.synthetic import SyntheticMoE, write_synthetic_moe

    shape = SyntheticMoE(hidden=64, intermediate=32, layers=2, experts=4, top_k=2, vocab=96, heads=4, kv_heads=2,
                         head_dim=16)
    write_synthetic_moe(tmp_path, shape)
    loaded = load_model(tmp_path)
    runner = build_torch_runner(loaded.spec, loaded.weights, kv_tokens=256)
    t = runner.traffic
    assert t is not None
    assert t.kv_bytes_per_token == loaded.spec.kv_bytes_per_token(4.0)  # float32 K and V
    assert t.expert_bytes * t.num_experts * t.moe_layers == shape.expert_bytes  # routed experts, counted apart
    engine = Engine(runner, None, EngineConfig(max_seqs=2, max_context=256), proposer=NgramProposer(min_n=1))
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, guard=GuardConfig(enabled=False))
    out = engine.generate([[5, 6, 7, 8] * 6], params)[0]
    cost = out.cost
    assert cost is not None
    tokens, times = cost["tokens"], cost["time_ms"]
    assert tokens["spec_proposed"] > 0 and 0 <= tokens["spec_accepted"] <= tokens["spec_proposed"]
    assert times["spec_verify"] > 0
    assert sum(times[p] for p in PHASES) == pytest.approx(times["total"], rel=1e-6)
    assert cost["bytes"]["weights_read"] > 0 and cost["bytes"]["experts_read"] > 0 and tokens["computed"] == 24


# -- the default model, through the engine and the server ----------------------------------------------
llama_cpp = pytest.importorskip("llama_cpp")

CTX, SEQS = 512, 2
PROMPT = ("You are a careful assistant. Answer briefly and plainly. Question: what are the three primary "
          "colors of paint, and why are they called primary?")  # > 1 KV block: the prefix cache engages


@pytest.fixture(scope="module")
def served() -> Iterator[dict[str, Any]]:
    from twinfer.app.models import open_model
    from twinfer.runtime.engine import Engine, EngineConfig, GuardConfig
    from twinfer.runtime.engine.async_engine import AsyncEngine
    from twinfer.server import create_app
    from twinfer.server.serve import ServerThread

    o = open_model(None, "llamacpp", max_seqs=SEQS, ctx=CTX, threads=1)
    engine = Engine(o.runner, o.tokenizer, EngineConfig(max_seqs=SEQS, max_context=CTX, replica="r0"))
    async_engine = AsyncEngine(engine)
    async_engine.start()
    st = ServerThread(create_app(async_engine, o.tokenizer, "m", guard=GuardConfig(enabled=False))).start()
    yield {"url": st.url, "engine": engine, "opened": o}
    st.call(async_engine.shutdown(drain=False))
    st.stop()
    o.runner.close()


def _post(url: str, path: str, body: dict[str, Any]) -> tuple[dict[str, Any], float]:
    with httpx.Client(timeout=300) as client:  # made before the clock starts: it builds an SSL context
        started = time.perf_counter()
        r = client.post(url + path, json=body)
        wall = time.perf_counter() - started
    assert r.status_code == 200, r.text
    return dict(r.json()), wall


def test_bill_adds_up_and_matches_the_planner(served: dict[str, Any]) -> None:
    from twinfer.planners.cost import kv_bytes_per_seq
    from twinfer.planners.formats import KV_FORMATS
    from twinfer.planners.source import profile_from_loaded
    from twinfer.runtime.loaders import load_model

    out, wall = _post(served["url"], "/v1/completions",
                      {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True})
    usage = out["usage"]
    cost = usage["cost"]
    times = cost["time_ms"]
    # the five phases partition the engine's view of the request, which is within 5% of the client's
    assert sum(times[p] for p in PHASES) == pytest.approx(times["total"], rel=1e-6)
    assert sum(times[p] for p in PHASES) == pytest.approx(wall * 1000.0, rel=0.05)
    assert times["prefill"] > 0 and times["decode"] > 0
    p, n = usage["prompt_tokens"], usage["completion_tokens"]
    assert n == 12 and cost["tokens"]["output"] == 12 and cost["tokens"]["prompt"] == p
    tokens = cost["tokens"]
    assert tokens["computed"] + tokens["cached"]["device"] == p
    assert usage["prompt_tokens_details"]["cached_tokens"] == tokens["cached"]["device"]
    assert cost["route"] == {"replica": "r0", "overlap_tokens": tokens["cached"]["device"]}

    # bytes: the planner's per-token figures on the same file
    profile = profile_from_loaded(load_model(None))
    steps = n  # one prefill step (the first token), then a decode step per further token
    planner_weights = profile.step_bytes(profile.stored, 0.0)
    assert cost["bytes"]["weights_read"] / steps == pytest.approx(planner_weights, rel=0.10)
    f16 = KV_FORMATS["f16"]
    computed = tokens["computed"]
    kv_per_token = kv_bytes_per_seq(profile, f16, 1)
    assert cost["bytes"]["kv_written"] == pytest.approx((computed + n - 1) * kv_per_token, rel=0.10)
    planner_read = kv_bytes_per_seq(profile, f16, p) + sum(kv_bytes_per_seq(profile, f16, c) for c in range(p + 1, p + n))
    assert cost["bytes"]["kv_read"] == pytest.approx(planner_read, rel=0.10)
    assert cost["bytes"]["kv_transferred"] == 0 and cost["bytes"]["experts_read"] == 0


def test_every_api_reports_the_bill_and_metrics_has_it(served: dict[str, Any]) -> None:
    url = served["url"]
    again, _ = _post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "temperature": 0})
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 16 and again["usage"]["cost"]["tokens"]["cached"]["device"] == cached  # the prefix cache

    chunks = []
    body = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 3, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    last = chunks[-1]
    assert last["choices"] == [] and last["usage"]["cost"]["tokens"]["output"] == last["usage"]["completion_tokens"]

    resp, _ = _post(url, "/v1/responses", {"input": "Say hi.", "max_output_tokens": 3, "temperature": 0})
    assert resp["usage"]["cost"]["tokens"]["output"] == resp["usage"]["output_tokens"]
    msg, _ = _post(url, "/v1/messages", {"model": "m", "max_tokens": 3,
                                         "messages": [{"role": "user", "content": "Say hi."}]})
    assert msg["usage"]["cost"]["tokens"]["output"] == msg["usage"]["output_tokens"]

    text = httpx.get(url + "/metrics", timeout=30).text
    finished = sum(1 for _ in (again, last, resp, msg))
    count = [line for line in text.splitlines() if line.startswith("twinfer_request_prefill_time_seconds_count")]
    assert count and float(count[0].split()[-1]) >= finished
    assert 'twinfer_request_cost_bytes_count{kind="weights_read"}' in text
    assert 'twinfer_request_cost_tokens_count{kind="cached_device"}' in text
