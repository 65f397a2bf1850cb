"""Plain-word reasons for a plan, the runners-up and why they lost, and the smallest change when nothing fits."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from twinfer.planners.calibration import Calibration
from twinfer.planners.cost import _native, kv_native, on_huge_pages
from twinfer.planners.formats import GOOD, LOSSY, MIXES, mix
from twinfer.planners.hardware import APPLE, Cluster
from twinfer.planners.memory import FULL_LENGTH_KV, max_concurrency, max_context, memory_for
from twinfer.planners.model import ModelProfile
from twinfer.planners.search import (
    Candidate,
    Request,
    as_published,
    explicit,
    first_refusal,
    mix_refusal,
    search,
    target_of,
)
from twinfer.planners.units import fmt_bytes, fmt_rate, fmt_seconds


def _needs_dequant(c: Candidate, cluster: Cluster) -> bool:
    """Whether the plan's weights or KV cache go through a dequantization loop on this device."""
    return not kv_native(cluster.device, c.strategy.kv) or any(not _native(cluster.device, f) for f in c.strategy.mix.formats() if f != "f32")


def _step_bytes(c: Candidate) -> float:
    s = c.strategy
    touched = c.profile.touched_experts(1)
    return c.profile.step_bytes(s.mix, touched) / (s.tp * s.pp)


def _compression_reason(c: Candidate, evaluated: list[Candidate], cluster: Cluster) -> str | None:
    dev, s, prof = cluster.device, c.strategy, c.profile
    native = MIXES.get(prof.native)
    chosen_bytes = prof.weight_bytes(s.mix)
    if not native or s.mix.name == native.name or chosen_bytes >= 0.95 * prof.weight_bytes(native):
        return None
    same = [e for e in evaluated if e.strategy.mix.name == native.name and e.strategy.kv == s.kv
            and (e.strategy.tp, e.strategy.pp, e.strategy.dp) == (s.tp, s.pp, s.dp) and e.strategy.prune == 0]
    ref = max(same, key=lambda e: e.step.tokens_per_s, default=None)
    head = (f"compressed to {s.mix.label or s.mix.name} because memory bandwidth is the bottleneck: at "
            f"{dev.bandwidth_gbs:g} GB/s each token reads {fmt_bytes(_step_bytes(c))} of weights per device, "
            f"{prof.weight_bytes(native) / chosen_bytes:.1f}x fewer bytes than {native.label or native.name}")
    if ref is None or not ref.fits:
        return head + f" (which, at {fmt_bytes(prof.weight_bytes(native))}, would not fit anyway)"
    gain = ref.single.latency_s / c.single.latency_s
    return (head + f"; decode gets {gain:.2f}x faster, and dequantization costs {fmt_seconds(c.single.dequant_s)} "
            f"per token against {fmt_seconds(ref.single.memory_s - c.single.memory_s)} of memory time saved")


def _native_reason(c: Candidate, evaluated: list[Candidate], cluster: Cluster) -> str | None:
    dev, s, prof = cluster.device, c.strategy, c.profile
    if _needs_dequant(c, cluster):
        return None
    chosen_bytes = prof.weight_bytes(s.mix)
    rivals = [e for e in evaluated if e.fits and _needs_dequant(e, cluster) and e.strategy.prune == 0
              and (e.strategy.tp, e.strategy.pp, e.strategy.dp) == (s.tp, s.pp, s.dp)
              and prof.weight_bytes(e.strategy.mix) < chosen_bytes]
    rival = max(rivals, key=lambda e: e.step.tokens_per_s, default=None)
    what = f"runs natively on {dev.label}'s matrix units" if dev.kind != APPLE else "needs no dequantization"
    if rival is None:
        return f"{s.mix.label or s.mix.name} {what}"
    saved = c.single.memory_s - rival.single.memory_s
    verdict = ("the bytes it saves were nearly free at this bandwidth" if rival.step.tokens_per_s <= c.step.tokens_per_s
               else "it is a little faster but less faithful")
    return (f"{s.mix.label or s.mix.name} {what}; {rival.strategy.mix.label} stores fewer bytes but needs a "
            f"dequantization loop costing {fmt_seconds(rival.single.dequant_s)} per token to save "
            f"{fmt_seconds(max(saved, 0.0))} of memory time at {dev.bandwidth_gbs:g} GB/s, decoding at "
            f"{fmt_rate(rival.step.tokens_per_s)} tok/s against {fmt_rate(c.step.tokens_per_s)}: {verdict}")


def _parallel_reason(c: Candidate, cluster: Cluster) -> list[str]:
    s, dev = c.strategy, cluster.device
    out: list[str] = []
    if cluster.world == 1:
        return out
    if s.tp > 1:
        out.append(f"tensor parallel TP{s.tp} inside the {dev.link} domain ({dev.interconnect_gbs:g} GB/s per GPU): "
                   f"its all-reduces cost {fmt_seconds(c.single.comm_s)} per token and split the weights "
                   f"{s.tp} ways, so each GPU reads {fmt_bytes(_step_bytes(c))} per token")
    if s.ep > 1:
        out.append(f"expert parallel EP{s.ep}: whole experts live on one GPU each, so expert matrices are not "
                   "sliced into small tiles at serving batch sizes")
    if s.pp > 1:
        per_node = cluster.capacity_per_device * cluster.gpus_per_node
        out.append(f"pipeline parallel PP{s.pp} across nodes, only because one node holds {fmt_bytes(per_node)} "
                   f"and the plan needs {fmt_bytes(c.memory.total_bytes)}; the {cluster.scale_out_gbs:g} GB/s "
                   "network between nodes is too slow for tensor or expert parallelism")
    if s.dp > 1:
        out.append(f"{s.dp} data-parallel replicas of {s.tp * s.pp} GPU(s) each serve separate requests")
    return out


def _moe_reason(c: Candidate, request: Request) -> str | None:
    prof, s = c.profile, c.strategy
    if not prof.moe:
        return None
    e, k = prof.moe.num_experts, prof.moe.top_k
    touched = prof.touched_experts(request.concurrency)
    if s.stream_fraction:
        return (f"at concurrency {request.concurrency} a step uses about {touched:.0f} of {e} experts per layer, so "
                f"{fmt_bytes(c.memory.resident_weights)} (dense layers plus {1 - s.stream_fraction:.0%} of the experts) "
                f"stay resident and the rest stream in when routed ({fmt_seconds(c.single.stream_s)} per token)")
    if touched / e > 0.5:
        return (f"full-parameter: at concurrency {request.concurrency} a step reaches about {touched:.0f} of {e} experts "
                f"per layer, so every expert must stay resident ({fmt_bytes(c.memory.weights_bytes)})")
    return f"all {e} experts resident; a token reads {k} of them per layer ({fmt_bytes(_step_bytes(c))} per token)"


def _window_note(c: Candidate, request: Request) -> str:
    spec = c.profile.spec
    windows = [w for w in (spec.window(i) for i in range(spec.num_layers)) if w]
    if c.strategy.engine in FULL_LENGTH_KV and windows and request.context > min(windows):
        why = "for exact rollback" if c.strategy.engine == "llamacpp" else "paged through the same block tables"
        return f" (the {c.strategy.engine} runner keeps sliding-window layers at full length, {why})"
    return ""


def _asked_reason(c: Candidate, cluster: Cluster, request: Request) -> str | None:
    """How a format named with --format is honoured: as asked, as its GGUF conversion where no runner here
    holds it as published, or on the llama.cpp runner where the datacenter target would serve only natives."""
    if not explicit(request):
        return None
    s, dev = c.strategy, cluster.device
    asked = as_published(c.profile, mix(request.weights_format)) if request.weights_format not in (
        "stored", "native") else (c.profile.stored or MIXES[c.profile.native])
    line = f"--format {request.weights_format}: {asked.label or asked.name}, as asked"
    if s.mix.name != asked.name:
        why = mix_refusal(c.profile, cluster, request, asked)
        line = (f"--format {request.weights_format} asks for {asked.label or asked.name}, which no runner here holds as "
                f"published ({why}); planned as {s.mix.label}, its GGUF conversion with the same quantized tensors, "
                f"on the llama.cpp runner")
    if target_of(cluster) == "datacenter" and _needs_dequant(c, cluster):
        line += (f"; not native on {dev.label} (its matrix units take {', '.join(sorted(dev.natives))}), so it runs "
                 "on the llama.cpp runner, which runs it there (left to choose, the datacenter target serves only "
                 "native formats)")
    return line


def explain(c: Candidate, evaluated: list[Candidate], cluster: Cluster, request: Request,
            cal: Calibration) -> tuple[list[str], list[str]]:
    s, mem, single = c.strategy, c.memory, c.single
    traffic = f"at {cluster.device.bandwidth_gbs:g} GB/s"
    if single.kernel_gbs:
        traffic = (f"with the weights read at about {single.kernel_gbs:.0f} GB/s, the rate llama.cpp's dot products "
                   f"stream them on {cluster.device.cores} cores, below the {cluster.device.bandwidth_gbs:g} GB/s "
                   "the memory reads")
    if s.engine == "llamacpp" and on_huge_pages(c.profile, cluster.device, s.mix):
        traffic += " (the weights on transparent huge pages: fewer TLB misses)"
    reasons = [
        f"decode is {single.bound}-bound: per token {fmt_seconds(single.memory_s)} of memory traffic {traffic}, "
        f"{fmt_seconds(single.compute_s)} of math, "
        f"{fmt_seconds(single.dequant_s)} of dequantization, {fmt_seconds(single.fixed_s)} of fixed per-layer cost",
    ]
    asked = _asked_reason(c, cluster, request)
    for line in (asked, None if asked else _compression_reason(c, evaluated, cluster), _native_reason(c, evaluated, cluster),
                 _moe_reason(c, request), *_parallel_reason(c, cluster)):
        if line:
            reasons.append(line)
    reasons.append(f"KV cache in {s.kv.label}: {fmt_bytes(mem.kv_bytes_per_token)} per token at {request.context} "
                   f"tokens of context, {fmt_bytes(mem.kv)} per device for {request.concurrency} sequence(s)"
                   + _window_note(c, request))
    if c.profile.spec.mla is not None and s.tp > 1:
        reasons.append(f"the MLA latent cache is replicated, not split, under TP{s.tp}: every rank's heads attend "
                       f"over the whole latent, so each GPU holds all {fmt_bytes(mem.kv_bytes_per_token)} per token")
    warnings = []
    if s.prune:
        warnings.append(f"pruned {s.prune:.0%} of the {'experts' if c.profile.moe else 'layers'} to fit: expect a "
                        "clear quality loss; measure it with `twinfer eval kl` before relying on it")
    if c.profile.mix_tier(s.mix) >= LOSSY or s.kv.tier >= LOSSY:
        warnings.append(f"{s.mix.label} / KV {s.kv.label} is a lossy format, chosen because nothing better fits")
    if c.profile.stored is not None and s.mix is not c.profile.stored:
        warnings.append("requantizing an already quantized GGUF compounds its error; start from the original weights "
                        "if you have them")
    return reasons, warnings


def runners_up(chosen: Candidate | None, evaluated: list[Candidate], limit: int = 5) -> list[dict[str, Any]]:
    """The best candidate of each other format/layout, with the reason it lost."""
    best: dict[tuple[Any, ...], Candidate] = {}
    for c in evaluated:
        s = c.strategy
        key = (s.mix.name, s.tp, s.ep, s.pp, s.prune, bool(s.stream_fraction))
        if chosen is not None and key == (chosen.strategy.mix.name, chosen.strategy.tp, chosen.strategy.ep,
                                          chosen.strategy.pp, chosen.strategy.prune, bool(chosen.strategy.stream_fraction)):
            continue
        if key not in best or (c.fits, c.speed) > (best[key].fits, best[key].speed):
            best[key] = c
    ranked = sorted(best.values(), key=lambda c: (not c.fits, -c.speed))[:limit]
    out = []
    for c in ranked:
        if not c.fits:
            why = f"does not fit: needs {fmt_bytes(c.memory.used)} of {fmt_bytes(c.memory.capacity)} per device"
        elif chosen is not None and c.speed < chosen.speed:
            why = (f"slower: {fmt_rate(c.speed)} vs {fmt_rate(chosen.speed)} tok/s "
                   f"({c.step.bound}-bound at {fmt_seconds(c.step.latency_s)} per step)")
        elif chosen is not None and c.tier > chosen.tier:
            why = f"faster ({fmt_rate(c.speed)} tok/s) but lower fidelity (tier {c.tier} vs {chosen.tier})"
        elif chosen is not None and c.kl > chosen.kl:
            why = (f"{fmt_rate(c.speed)} tok/s, not enough faster to pay for its expected KL "
                   f"({c.kl:.3g} vs {chosen.kl:.3g} nats)")
        else:
            why = f"{fmt_rate(c.speed)} tok/s at equal fidelity; the chosen plan uses fewer GPUs per replica"
        out.append({"strategy": c.strategy.label(), "fits": c.fits,
                    "decode_tokens_per_s_at_concurrency": c.speed, "why": why})
    return out


def closest(evaluated: list[Candidate], cluster: Cluster) -> Candidate | None:
    """The faithful plan that comes nearest to fitting (on a datacenter target, among native formats)."""
    good = [c for c in evaluated if c.tier <= GOOD and not c.strategy.prune] or evaluated
    if target_of(cluster) == "datacenter":
        good = [c for c in good if not _needs_dequant(c, cluster)] or good
    return min(good, key=lambda e: e.memory.used / e.memory.capacity, default=None)


def smallest_change(model: ModelProfile, cluster: Cluster, request: Request, evaluated: list[Candidate],
                    cal: Calibration) -> str:
    """One line: the least change to the request or the hardware that makes some good plan fit."""
    c = closest(evaluated, cluster)
    if c is None:
        why = first_refusal(model, cluster, request)
        return f"no runner runs what was asked: {why}" if why else "no strategy applies to this model and hardware"
    s, prof = c.strategy, c.profile
    if c.fits:  # memory is not what stops it: nothing allowed runs natively here
        return _not_native(model, cluster, request, c)
    if request.concurrency > 1 and memory_for(prof, cluster, s, 1, request.context).fits:
        n = max_concurrency(prof, cluster, s, request.context)
        return (f"lower --concurrency to {n}: at {request.context} tokens the KV budget holds {n} sequence(s) "
                f"in {s.mix.label or s.mix.name}")
    ctx = max_context(prof, cluster, s, request.concurrency)
    if request.context > ctx >= 256:
        return f"lower --context to {ctx}: the weights fit, the KV cache for {request.context} tokens does not"
    need = c.memory.used * c.memory.devices
    if target_of(cluster) == "local":
        return _bigger_device(cluster, need, c)
    more = _more_gpus(model, cluster, request, c, cal) if cluster.device.kind == "gpu" else None
    if more:
        return more
    return (f"needs about {fmt_bytes(need)} even as {s.mix.label or s.mix.name}; this {cluster.device.label} "
            f"offers {fmt_bytes(cluster.capacity_bytes)} usable: choose hardware with more memory")


def _not_native(model: ModelProfile, cluster: Cluster, request: Request, c: Candidate) -> str:
    """Why a plan that fits in memory was refused: the datacenter target runs native formats only."""
    dev = cluster.device
    units = f"{dev.label}, whose matrix units take {', '.join(sorted(dev.natives))}"
    asked = [f"--{flag} {value}" for flag, value in (("format", request.weights_format),
                                                      ("kv-format", request.kv_format)) if value not in ("auto", "")]
    if asked:
        return (f"{' with '.join(asked)} does not run natively on {units}; the datacenter target serves only "
                "native formats: drop it and the planner picks one")
    return (f"no format of {model.name} runs natively on {units}; {c.strategy.label()} fits but needs a "
            "dequantization loop, which the datacenter target does not spend kernel time on")


MAX_SEARCHES = 12  # cluster sizes `smallest_change` tries before it gives up naming a GPU count


def _more_gpus(model: ModelProfile, cluster: Cluster, request: Request, c: Candidate, cal: Calibration) -> str | None:
    """`use --gpus N [--nodes M]` for the fewest GPUs that fit `c`'s formats, or None; at most
    `MAX_SEARCHES` sizes that can hold the weights are searched, so hopeless requests answer at once."""
    s = c.strategy
    fixed = replace(request, weights_format=s.mix.name, kv_format=s.kv.name)
    top = cluster.device.max_per_node
    tries = 0
    for nodes in range(cluster.nodes, 65):
        first = cluster.gpus_per_node + 1 if nodes == cluster.nodes else top
        for gpus in range(first, top + 1):
            if top % gpus or cluster.capacity_per_device * gpus * nodes < c.memory.weights_bytes:
                continue  # only node-sized splits (1, 2, 4, 8 ...) that could hold the weights at all
            tries += 1
            if tries > MAX_SEARCHES:
                return None
            bigger = replace(cluster, gpus_per_node=gpus, nodes=nodes)
            chosen, _ = search(model, bigger, fixed, cal)
            if chosen is not None:
                return (f"use --gpus {gpus}" + (f" --nodes {nodes}" if nodes > 1 else "")
                        + f": {gpus * nodes}x {cluster.device.label} fit it as {chosen.strategy.label()}")
    return None


def _bigger_device(cluster: Cluster, need: float, c: Candidate) -> str:
    """Local target: name the smallest device of the same kind (and memory size) that would hold `need`."""
    from twinfer.planners.hw_table import DEVICES

    usable = cluster.usable_fraction
    options = []
    for d in DEVICES.values():
        if d.kind != cluster.device.kind:
            continue
        for gb in d.memory_options_gb or (d.memory_gb,):
            if gb * 1e9 * usable >= need:
                options.append((gb, d.bandwidth_gbs, d.name + (f"@{gb:g}" if d.memory_options_gb else "")))
    head = (f"needs about {fmt_bytes(need)} even as {c.strategy.mix.label or c.strategy.mix.name}, and this "
            f"{cluster.device.label} offers {fmt_bytes(cluster.capacity_bytes)} usable")
    machine = cluster.device.memory_bytes * usable
    if cluster.memory_budget_bytes is not None and machine >= need:  # the smallest change: the budget itself
        return head + (f" under the budget; raise --memory-budget to {math.ceil(need / 1e6)} MB "
                       f"(the machine has {fmt_bytes(machine)} usable)")
    if not options:
        return head + "; no single device of this kind holds it: plan it on a GPU server (--hardware hgx-h200)"
    gb, _, name = min(options, key=lambda o: (o[0], -o[1]))
    return head + f"; the smallest {cluster.device.kind} in the table that holds it is --hardware {name}"
