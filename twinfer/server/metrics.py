"""Prometheus metrics of one server, in its own registry: per-request numbers from the handlers,
engine state from the latest `EngineStats` snapshot at scrape time."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from twinfer.runtime.engine.async_engine import AsyncEngine, EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
_COST_PHASES = ("queue", "prefill", "decode", "kv_transfer", "spec_verify")  # vLLM: request_queue_time_seconds...
_TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144)
_BYTE_BUCKETS = tuple(float(4**i) * 1024 for i in range(16))  # 1 KiB .. 1 TiB
_TPOT_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


class _EngineCollector(Collector):
    def __init__(self, engine: Callable[[], AsyncEngine | None]):
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        engine = self.engine()
        yield GaugeMetricFamily("twinfer_engine_up", "1 while the engine thread runs", value=int(bool(engine and engine.alive)))
        if engine is None:
            return
        s = engine.stats
        gauges = [
            ("twinfer_queue_depth", "requests waiting to be scheduled", s.waiting),
            ("twinfer_requests_running", "requests being computed", s.running),
            ("twinfer_requests_active", "requests submitted and not yet finished", engine.active),
            ("twinfer_kv_blocks_used", "KV-cache blocks held by requests", s.kv_blocks_used),
            ("twinfer_kv_blocks_total", "KV-cache blocks in the pool", s.kv_blocks_total),
            ("twinfer_kv_usage_ratio", "fraction of KV-cache blocks in use", s.kv_usage),
            ("twinfer_prefix_cache_hit_rate", "prompt tokens served from the prefix cache / prompt tokens", s.prefix_hit_rate),
        ]
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=value)
        yield from _vllm_load(s)
        yield CounterMetricFamily("twinfer_guard_trips", "times the token-loop guard cut a generation", value=s.guard_trips)
        yield CounterMetricFamily("twinfer_preemptions", "requests preempted for KV memory", value=s.preemptions)
        yield CounterMetricFamily("twinfer_engine_steps", "engine steps run", value=s.steps)
        yield from _speculative(s.speculative)
        yield from _constraints(s.constraints)


def _vllm_load(s: EngineStats) -> Iterator[Metric]:
    """vLLM's load gauges under vLLM's names, which KV- and load-aware routers (llm-d, Dynamo, gateways) scrape."""
    yield GaugeMetricFamily("vllm:num_requests_running", "requests in model execution batches", value=s.running)
    yield GaugeMetricFamily("vllm:num_requests_waiting", "requests waiting to be processed", value=s.waiting)
    for name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):  # the new name and the older one
        yield GaugeMetricFamily(name, "KV-cache usage: 1 means 100 percent", value=s.kv_usage)


def _constraints(c: dict[str, float]) -> Iterator[Metric]:
    """Structured output: constrained requests, grammar compiles and the mask work of the steps."""
    if not c:
        return
    counters = [
        ("twinfer_constrained_requests", "requests generated under a grammar (JSON schema, regex, tools...)",
         "constrained_requests"),
        ("twinfer_grammar_compiles", "grammars compiled (cache misses)", "compiles"),
        ("twinfer_grammar_compile_failures", "grammars refused: invalid or over the compile time limit",
         "compile_failures"),
        ("twinfer_grammar_compile_seconds", "seconds spent compiling grammars", "compile_seconds"),
        ("twinfer_mask_steps", "engine steps (and draft positions) that computed grammar masks", "mask_steps"),
        ("twinfer_mask_rows", "rows masked", "mask_rows"),
        ("twinfer_mask_seconds", "seconds spent computing and applying grammar masks", "mask_seconds"),
    ]
    for name, doc, key in counters:
        yield CounterMetricFamily(name, doc, value=c.get(key, 0))
    steps = c.get("mask_steps", 0)
    yield GaugeMetricFamily("twinfer_mask_seconds_per_step", "mean grammar-mask time of a masked step",
                            value=c.get("mask_seconds", 0) / steps if steps else 0.0)


def _speculative(spec: dict[str, Any]) -> Iterator[Metric]:
    """Speculative decoding counters, labelled by proposer (nothing when speculation is off)."""
    if not spec:
        return
    counters = [
        ("twinfer_spec_proposed_tokens", "draft tokens verified by the target model", "proposed"),
        ("twinfer_spec_accepted_tokens", "draft tokens the target model kept", "accepted"),
        ("twinfer_spec_verifications", "decode steps that verified a draft", "verifications"),
    ]
    for name, doc, key in counters:
        family = CounterMetricFamily(name, doc, labels=["proposer"])
        family.add_metric([spec["proposer"]], spec[key])
        yield family
    gauges = [
        ("twinfer_spec_acceptance_rate", "accepted / proposed draft tokens", "acceptance_rate"),
        ("twinfer_spec_speedup_estimate", "decode tokens per unit time vs no speculation (cost model)",
         "speedup_estimate"),
    ]
    for name, doc, key in gauges:
        gauge = GaugeMetricFamily(name, doc, labels=["proposer"])
        gauge.add_metric([spec["proposer"]], spec[key])
        yield gauge


class ServerMetrics:
    """The registry and the per-request instruments of one app."""

    def __init__(self, engine: Callable[[], AsyncEngine | None]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.http_requests = Counter("twinfer_http_requests", "HTTP requests to /v1 routes by route and status",
                                     ["route", "status"], registry=r)
        self.finished = Counter("twinfer_request_finish", "generations finished, by finish reason", ["reason"], registry=r)
        self.prompt_tokens = Counter("twinfer_prompt_tokens", "prompt tokens of finished generations", registry=r)
        self.generation_tokens = Counter("twinfer_generation_tokens", "tokens generated", registry=r)
        self.cached_tokens = Counter("twinfer_prompt_cached_tokens",
                                     "prompt tokens of finished generations served from the prefix cache", registry=r)
        self.tool_parse_failures = Counter("twinfer_tool_call_parse_failures",
                                           "tool calls the model wrote malformed (returned as content)", registry=r)
        self.ttft = Histogram("twinfer_time_to_first_token_seconds", "request arrival to first output token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("twinfer_time_per_output_token_seconds", "mean time between output tokens of a request",
                              buckets=_TPOT_BUCKETS, registry=r)
        self.latency = Histogram("twinfer_request_latency_seconds", "request arrival to last token",
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.cost_time = {phase: Histogram(f"twinfer_request_{phase}_time_seconds", f"per-request {phase} time (the bill)",
                                           buckets=_LATENCY_BUCKETS, registry=r) for phase in _COST_PHASES}
        self.cost_tokens = Histogram("twinfer_request_cost_tokens", "per-request tokens of the bill, by kind",
                                     ["kind"], buckets=_TOKEN_BUCKETS, registry=r)
        self.cost_bytes = Histogram("twinfer_request_cost_bytes", "per-request bytes moved (the bill), by kind",
                                    ["kind"], buckets=_BYTE_BUCKETS, registry=r)
        r.register(_EngineCollector(engine))

    def record_http(self, route: str, status: int) -> None:
        known = route in ("/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/messages",
                          "/v1/messages/count_tokens", "/v1/responses")
        self.http_requests.labels(route if known else "other", str(status)).inc()

    def record_finish(self, reason: str, prompt_tokens: int, completion_tokens: int,
                      ttft_s: float | None, tpot_s: float | None, latency_s: float, cached_tokens: int = 0,
                      tool_parse_failures: int = 0) -> None:
        self.finished.labels(reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_tokens.inc(cached_tokens)
        self.tool_parse_failures.inc(tool_parse_failures)
        self.generation_tokens.inc(completion_tokens)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        if tpot_s is not None:
            self.tpot.observe(tpot_s)
        self.latency.observe(latency_s)

    def record_cost(self, cost: dict[str, Any]) -> None:
        """A finished request's bill (engine/bill.py) into the histograms."""
        for phase, hist in self.cost_time.items():
            hist.observe(cost["time_ms"].get(phase, 0.0) / 1000.0)
        tokens = dict(cost["tokens"])
        for tier, n in tokens.pop("cached").items():
            self.cost_tokens.labels(f"cached_{tier}").observe(n)
        for kind, n in tokens.items():
            self.cost_tokens.labels(kind).observe(n)
        for kind, n in cost["bytes"].items():
            self.cost_bytes.labels(kind).observe(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)
