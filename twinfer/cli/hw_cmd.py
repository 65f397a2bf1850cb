"""`twinfer hw`: the hardware profile the planner sees, the published table, or a measurement."""

from __future__ import annotations

import json


def run_hw(list_table: bool, json_out: bool, measure: bool, hardware: str) -> None:
    from twinfer.planners.report import render_cluster, render_devices

    if list_table:
        from twinfer.planners.hw_table import DEVICES, NODES

        rows = [d.row() for d in DEVICES.values()] + [n.row(DEVICES[n.device]) for n in NODES]
        print(json.dumps(rows, indent=1) if json_out else render_devices(rows))
        return
    from twinfer.planners import probe
    from twinfer.planners.describe import resolve_cluster

    measured: dict[str, float] = {}
    if measure:
        measured["cpu read bandwidth"] = probe.measure_cpu_bandwidth()
        measured["cpu f32 gemm"] = probe.measure_cpu_gemm()
        gpu = probe.measure_gpu_copy_bandwidth()
        if gpu is not None:
            measured["gpu copy bandwidth"] = gpu
    from twinfer.planners.llamacpp_build import read_build

    cluster = resolve_cluster(hardware, None, None, None, follow_build=False)  # what was found, not what a plan falls back to
    build = cluster.llamacpp_build or read_build()
    if json_out:
        out = cluster.device.row()
        out.update(gpus_per_node=cluster.gpus_per_node, nodes=cluster.nodes,
                   capacity_bytes_per_device=cluster.capacity_per_device, measured=measured,
                   notes=list(cluster.notes),
                   llamacpp_build={**build.to_json(), "runs_device": build.backend_for(cluster.device) is not None}
                   if build else None)
        if cluster.device.cores:  # a CPU: what llama.cpp's kernels get here
            out.update(cores=cluster.device.cores, repacks=list(cluster.device.repacks),
                       huge_pages=cluster.device.huge_pages)
        print(json.dumps(out, indent=1))
    else:
        print(render_cluster(cluster, measured, build))
