"""The readable `twinfer plan` report and the `twinfer hw` listings (plain text, no heavy imports)."""

from __future__ import annotations

from twinfer.planners.hardware import CPU, Cluster, Device
from twinfer.planners.placement import GPU_BUILD_HINT, LlamaBuild
from twinfer.planners.plan import Plan
from twinfer.planners.units import fmt_bytes, fmt_count, fmt_rate, fmt_seconds


def render_plan(plan: Plan) -> str:
    m, c, req = plan.model, plan.cluster, plan.request
    active = f", {fmt_count(m.active_params)} active" if m.moe else ""
    lines = [
        f"model     {m.name}: {fmt_count(m.total_params)} parameters{active}, {m.spec.num_layers} layers ({m.source})",
        f"hardware  {c.describe()} -> {plan.target} target",
        f"request   context {req.context} tokens, concurrency {req.concurrency}",
        "",
    ]
    chosen = plan.chosen
    if chosen is None or plan.strategy is None:
        lines += ["fits      NO", f"smallest change: {plan.suggestion}"]
        lines += _alternatives(plan)
        return "\n".join(lines + _notes(plan))
    s, mem = plan.strategy, chosen.memory
    used = mem.used
    lines += [
        f"fits      yes: {s.label()}",
        *([f"llama.cpp {plan.placement.args()}" + _experts_line(plan)] if plan.placement else []),
        "memory per device",
        f"  weights      {fmt_bytes(mem.resident_weights)}"
        + (f" resident (+{fmt_bytes(mem.streamed_weights)} streamed)" if mem.streamed_weights else "")
        + (f" of {fmt_bytes(mem.weights_bytes)} total" if mem.devices > 1 else ""),
        f"  KV cache     {fmt_bytes(mem.kv)}  ({fmt_bytes(mem.kv_bytes_per_token)}/token x {req.context} tokens"
        f" x {req.concurrency} sequence(s))",
        *_vision_lines(plan),
        f"  activations  {fmt_bytes(mem.activations)}",
        f"  runtime      {fmt_bytes(mem.overhead)}",
        f"  total        {fmt_bytes(used)} of {fmt_bytes(mem.capacity)} usable ({used / mem.capacity:.0%})",
        "predicted",
        f"  decode       {fmt_rate(1 / chosen.single.latency_s)} tok/s single stream ({chosen.single.bound}-bound)",
    ]
    if req.concurrency > 1:
        lines.append(f"               {fmt_rate(chosen.step.tokens_per_s)} tok/s at concurrency {req.concurrency} "
                     f"({fmt_rate(1 / chosen.step.latency_s)} tok/s per stream)")
    lines += [
        f"  first token  {fmt_seconds(plan.ttft_s)} for a {req.context}-token prompt",
        f"  limits       {plan.max_concurrency} sequence(s) at {req.context} tokens; "
        f"{plan.max_context} tokens of context at concurrency {req.concurrency}",
        "why",
        *(f"  - {r}" for r in plan.reasons),
    ]
    if plan.warnings:
        lines += ["warnings", *(f"  ! {w}" for w in plan.warnings)]
    lines += _alternatives(plan)
    return "\n".join(lines + _notes(plan))


def _vision_lines(plan: Plan) -> list[str]:
    """The vision encoder's weights and the image tokens' KV (a model with a vision encoder only)."""
    v, c = plan.model.vision, plan.chosen
    if v is None or c is None:
        return []
    return [f"  vision       {fmt_bytes(c.memory.vision_weights)}  (encoder + projector, "
            f"{fmt_count(v.params)} parameters)",
            f"  image KV     {fmt_bytes(c.memory.image_kv)}  ({v.tokens_per_image} tokens/image x {v.images} image(s)"
            f" x {plan.request.concurrency} sequence(s))"]


def _experts_line(plan: Plan) -> str:
    p = plan.placement
    if p is None or not p.cpu_moe_layers:
        return ""
    n = p.num_layers if p.cpu_moe_layers >= p.num_layers else p.cpu_moe_layers
    return f"  (routed experts of the first {n} of {p.num_layers} layers in host memory)"


def _alternatives(plan: Plan) -> list[str]:
    if not plan.alternatives:
        return []
    return ["runners-up", *(f"  - {a['strategy']}: {a['why']}" for a in plan.alternatives)]


def _notes(plan: Plan) -> list[str]:
    return ["notes", *(f"  * {n}" for n in plan.notes)] if plan.notes else []


def render_devices(rows: list[dict[str, object]]) -> str:
    head = f"{'name':<20} {'memory GB':>9} {'GB/s':>7} {'link GB/s':>9} {'TFLOPS':>7}  label"
    out = [head, "-" * 84]
    for r in rows:
        tensor = r["tensor_tflops"] if isinstance(r["tensor_tflops"], dict) else {}
        peak = max(tensor.get(k, 0.0) for k in ("bf16", "f16", "f32")) or r["vector_tflops"]  # 16-bit matrix peak
        out.append(f"{r['name']!s:<20} {r['memory_gb']!s:>9} {r['bandwidth_gbs']!s:>7} "
                   f"{r['interconnect_gbs']!s:>9} {float(str(peak)):>7.4g}  {r['label']}")
    out.append("(TFLOPS: dense 16-bit matrix peak, else FP32; `twinfer hw --hardware NAME` shows each row's source)")
    return "\n".join(out)


def render_cluster(cluster: Cluster, measured: dict[str, float], build: LlamaBuild | None = None) -> str:
    d: Device = cluster.device
    lines = [
        f"device      {d.label} ({d.name})",
        f"kind        {d.kind}, {d.memory_type} memory" + (f", {d.gpu_cores} GPU cores" if d.gpu_cores else ""),
        f"count       {cluster.gpus_per_node} per node x {cluster.nodes} node(s)",
        f"memory      {d.memory_gb:g} GB each, {fmt_bytes(cluster.capacity_per_device)} usable by a runtime",
        f"bandwidth   {d.bandwidth_gbs:g} GB/s" + (" (measured)" if d.measured else ""),
        f"compute     {', '.join(f'{k} {v:.4g}' for k, v in d.tensor_tflops)} TFLOPS; vector {d.vector_tflops:.3g} TFLOPS",
        f"link        {d.link} {d.interconnect_gbs:g} GB/s",
        f"source      {d.source}",
    ]
    if d.kind == CPU and d.cores:
        lines.insert(-1, f"llama.cpp   {d.cores} threads; repacks {', '.join(d.repacks) or 'no format'} into its tiles; "
                         + ("weights on transparent huge pages" if d.huge_pages else "weights on 4 KiB pages (no THP)"))
    if build is not None:
        lines.append(f"build       {build.describe()}")
        backend = build.backend_for(d)
        lines.append(f"            runs this {d.kind} with its {backend} backend" if backend else
                     f"            {build.kind()}: cannot use this {d.kind}; plans for it assume a GPU build. "
                     f"To get one: {GPU_BUILD_HINT}")
    lines += [f"measured    {k}: {v:.1f} {'GB/s' if k.endswith('bandwidth') else 'GFLOP/s'}" for k, v in measured.items()]
    lines += [f"note        {n}" for n in cluster.notes]
    return "\n".join(lines)
