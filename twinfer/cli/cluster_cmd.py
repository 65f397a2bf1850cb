"""`twinfer cluster`: replicas (or prefill/decode pools) of `twinfer serve` behind SGLang's Model Gateway."""

from __future__ import annotations

import sys

from twinfer.app.cluster import Cluster, ClusterConfig, describe


def run_cluster(cfg: ClusterConfig) -> None:
    if cfg.disaggregated:
        print(f"twinfer: starting {cfg.prefill} prefill and {cfg.decode} decode replicas", file=sys.stderr)
    else:
        print(f"twinfer: starting {cfg.replicas} replica{'s' if cfg.replicas != 1 else ''}", file=sys.stderr)
    cluster = Cluster(cfg)
    cluster.start()
    for line in describe(cluster):
        print(f"twinfer: {line}", file=sys.stderr)
    cluster.run()
