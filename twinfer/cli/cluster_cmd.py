"""`twinfer cluster`: replicas (or prefill/decode pools) of `twinfer serve` behind SGLang's Model Gateway."""

from __future__ import annotations

import sys
from pathlib import Path

from twinfer.app.cluster import Cluster, ClusterConfig, describe


def run_cluster(model: str | None, replicas: int, prefill: int, decode: int, policy: str, host: str, port: int,
                threads: int | None, ctx: int, max_seqs: int, kv_events: bool, startup_timeout: float,
                log_dir: str | None, serve_args: tuple[str, ...] = ()) -> None:
    cfg = ClusterConfig(model, replicas, prefill, decode, policy, host, port, threads, ctx, max_seqs, serve_args,
                        kv_events, startup_timeout, log_dir=Path(log_dir) if log_dir else None)
    if cfg.disaggregated:
        print(f"twinfer: starting {prefill} prefill and {decode} decode replicas", file=sys.stderr)
    else:
        print(f"twinfer: starting {replicas} replica{'s' if replicas != 1 else ''}", file=sys.stderr)
    cluster = Cluster(cfg)
    cluster.start()
    for line in describe(cluster):
        print(f"twinfer: {line}", file=sys.stderr)
    cluster.run()
