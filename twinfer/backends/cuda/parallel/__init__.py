"""Tensor, expert and pipeline parallelism for the torch backend, as transforms of a built model.
layout.py: the rank grid; shard.py: which slice of each weight a rank holds; model.py: the Ops that
combine the slices and a pipeline step; wire.py: step inputs as tensors; runner.py: processes."""

from twinfer.backends.cuda.parallel.layout import ParallelConfig, RankPosition
from twinfer.backends.cuda.parallel.runner import (
    DistributedRunner,
    RunOptions,
    WeightSource,
    from_torchrun,
    launch,
    under_torchrun,
)

__all__ = ["DistributedRunner", "ParallelConfig", "RankPosition", "RunOptions", "WeightSource", "from_torchrun",
           "launch", "under_torchrun"]
