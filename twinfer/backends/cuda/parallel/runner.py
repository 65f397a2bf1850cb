"""Run a model over several processes: `DistributedRunner` on rank 0, `serve_steps` on the others.
`launch` spawns ranks inside a node, `from_torchrun` connects torchrun's ranks (docs/parallelism.md);
each step rank 0 broadcasts the StepBatch as int64 tensors."""

from __future__ import annotations

import contextlib
import os
import sys
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
import torch.multiprocessing as mp

from twinfer.backends.cuda.parallel.comm import Comm, make_comm, make_store
from twinfer.backends.cuda.parallel.layout import ParallelConfig, RankPosition
from twinfer.backends.cuda.parallel.model import ShardedModel
from twinfer.backends.cuda.parallel.shard import HostWeights, WeightReader
from twinfer.backends.cuda.parallel.wire import RELEASE, STEP, STOP, decode, encode
from twinfer.runtime.batch import StepBatch
from twinfer.runtime.errors import BackendUnavailable
from twinfer.runtime.kv.block_manager import BlockManager
from twinfer.runtime.kv.traffic import StepTraffic, kv_layer_bytes, resident_traffic
from twinfer.runtime.runner import KVLayout, KVSync, Runner
from twinfer.runtime.spec import ModelSpec


@dataclass(frozen=True)
class WeightSource:
    """Where every rank reads its part of the weights from: a model path, or (tests) a spec and host arrays."""

    path: str | None = None
    spec: ModelSpec | None = None
    weights: dict[str, np.ndarray] | None = field(default=None, repr=False)

    def open(self) -> tuple[ModelSpec, WeightReader]:
        """The spec and a reader; opening a model file reads its header, not its tensors."""
        if self.path is not None:
            from twinfer.runtime.loaders import load_model

            loaded = load_model(Path(self.path))
            return loaded.spec, loaded.weights
        assert self.spec is not None and self.weights is not None
        return self.spec, HostWeights(self.weights)


@dataclass(frozen=True)
class RunOptions:
    """How each rank builds its shard (same on every rank)."""

    device: str = "cpu"  # "cpu" or "cuda"; rank r uses cuda:(local rank)
    dtype: str = "float32"
    kv_tokens: int = 4096
    block_size: int = 16
    threads: int = 1  # torch CPU threads per rank
    timeout_s: float = 300.0  # rendezvous and collective timeout

    @property
    def kv(self) -> KVLayout:
        return KVLayout(block_size=self.block_size, num_blocks=-(-self.kv_tokens // self.block_size))


def _device(opts: RunOptions, local_rank: int) -> torch.device:
    if opts.device == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))


def build_shard(source: WeightSource, config: ParallelConfig, rank: int, opts: RunOptions,
                local_rank: int) -> ShardedModel:
    """This rank's sharded model (weights loaded, process groups not yet joined)."""
    torch.set_num_threads(max(1, opts.threads))
    spec, weights = source.open()
    pos = RankPosition(config, rank, spec.num_layers)
    return ShardedModel(spec, pos, weights, device=_device(opts, local_rank), dtype=getattr(torch, opts.dtype),
                        num_blocks=opts.kv.num_blocks, block_size=opts.block_size)


def join_groups(store: Any, pos: RankPosition, device: torch.device, timeout_s: float) -> dict[str, Comm]:
    """Every rank joins its groups in the same order: control (always gloo), world, stage, tp."""
    world = list(range(pos.config.world_size))
    cpu = torch.device("cpu")
    return {
        "control": make_comm(store, "control", world, pos.rank, cpu, timeout_s),
        "world": make_comm(store, "world", world, pos.rank, device, timeout_s),
        "stage": make_comm(store, f"stage{pos.stage}", pos.stage_ranks, pos.rank, device, timeout_s),
        "tp": make_comm(store, f"tp{pos.stage}.{pos.expert_group}", pos.tp_group_ranks, pos.rank, device, timeout_s),
    }


def serve_steps(model: ShardedModel) -> None:
    """Worker loop (ranks > 0): receive each step's inputs from rank 0 and run this rank's stage."""
    control = model.comms["control"]
    header = torch.zeros(2, dtype=torch.int64)
    while True:
        control.broadcast(header, 0)
        command, n = header.tolist()
        if command == STOP:
            return
        if command == RELEASE:
            model.release(n)
            continue
        payload = control.broadcast(torch.empty(n, dtype=torch.int64), 0)
        model.step(decode(payload))


def _worker_main(rank: int, port: int, source: WeightSource, config: ParallelConfig, opts: RunOptions,
                 conn: Connection) -> None:
    try:
        model = build_shard(source, config, rank, opts, rank)
    except Exception as e:  # reported to rank 0, which raises it as a one-line error
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", ""))
    store = make_store("127.0.0.1", port, config.world_size, False, opts.timeout_s)
    model.connect(join_groups(store, model.pos, model.ops.device, opts.timeout_s))
    try:
        serve_steps(model)
    finally:
        for comm in model.comms.values():
            comm.shutdown()


class DistributedRunner(Runner):
    """Rank 0's runner: broadcasts each step to the workers, runs its own stage, returns the logits."""

    def __init__(self, model: ShardedModel, kv: KVLayout, procs: list[Any], store: Any = None):
        self.spec, self.kv, self.backend = model.spec, replace(kv, recurrent=model.spec.recurrent), "torch"
        self.model, self.procs, self._store = model, procs, store
        self._closer = weakref.finalize(self, _shutdown, model.comms, procs)

    @property
    def config(self) -> ParallelConfig:
        return self.model.pos.config

    def step(self, batch: StepBatch) -> np.ndarray:
        if not self._closer.alive:
            raise BackendUnavailable("this parallel runner was closed")
        self._check_workers()
        payload = encode(batch)
        control = self.model.comms["control"]
        try:
            control.broadcast(torch.tensor([STEP, payload.numel()], dtype=torch.int64), 0)
            control.broadcast(payload, 0)
            out = self.model.step(batch)
        except RuntimeError as e:
            self._check_workers()
            raise BackendUnavailable(f"a parallel step failed ({self.config.describe()}): {e}") from e
        assert out is not None
        return out

    def release(self, seq_id: int) -> None:
        """Every rank frees the sequence's recurrent state slots (linear-attention layers)."""
        if not self.spec.recurrent or not self._closer.alive:
            return
        self.model.comms["control"].broadcast(torch.tensor([RELEASE, seq_id], dtype=torch.int64), 0)
        self.model.release(seq_id)

    def kv_sync(self, blocks: BlockManager, slots: int, running: Callable[[], int]) -> KVSync:
        if not self.spec.recurrent:
            return KVSync()
        from twinfer.runtime.kv.recurrent import StateSync

        return StateSync(self.release)  # as OpsRunner: state slots go back when a sequence leaves

    def _check_workers(self) -> None:
        for rank, p in enumerate(self.procs, start=1):
            if not p.is_alive():
                self.close()
                raise BackendUnavailable(f"parallel worker rank {rank} exited with code {p.exitcode}; "
                                         "see its error above, then restart")

    def close(self) -> None:
        """Stop the workers and leave the process groups (also runs when the runner is collected)."""
        self._closer()

    def describe(self) -> dict[str, Any]:
        c = self.config
        return {"backend": "torch", "device": str(self.model.ops.device), "dtype": str(self.model.ops.dtype),
                "tp": c.tp, "ep": c.ep, "pp": c.pp, "world_size": c.world_size, "torch": torch.__version__}


def _shutdown(comms: dict[str, Comm], procs: list[Any]) -> None:
    if comms and all(p.is_alive() for p in procs):
        with contextlib.suppress(RuntimeError):
            comms["control"].broadcast(torch.tensor([STOP, 0], dtype=torch.int64), 0)
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.terminate()
            p.join(timeout=5)
    for comm in comms.values():
        comm.shutdown()


def launch(source: WeightSource, config: ParallelConfig, opts: RunOptions) -> DistributedRunner:
    """Start ranks 1..N-1 on this machine, build rank 0 here, connect them; a worker's failure is raised."""
    spec = source.open()[0]
    config.check(spec)
    if opts.device == "cuda" and torch.cuda.device_count() < config.world_size:
        raise BackendUnavailable(f"{config.describe()} needs {config.world_size} GPUs; "
                                 f"this machine has {torch.cuda.device_count()}")
    store = make_store("127.0.0.1", 0, config.world_size, True, opts.timeout_s)
    ctx = mp.get_context("spawn")
    procs, conns = [], []
    for rank in range(1, config.world_size):
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_worker_main, args=(rank, store.port, source, config, opts, child), daemon=True,
                        name=f"twinfer-rank{rank}")
        p.start()
        procs.append(p)
        conns.append(parent)
    try:
        model = build_shard(source, config, 0, opts, 0)
        _wait_ready(procs, conns, opts.timeout_s)
        model.connect(join_groups(store, model.pos, model.ops.device, opts.timeout_s))
    except BaseException:
        for p in procs:
            p.terminate()
            p.join(timeout=5)
        raise
    runner = DistributedRunner(model, opts.kv, procs, store)
    runner.traffic = whole_model_traffic(source, opts)
    return runner


def whole_model_traffic(source: WeightSource, opts: RunOptions) -> StepTraffic:
    """The bill's bytes for all ranks together, as the planner counts the model: every weight once in the
    ranks' dtype (a replicated one too), every layer's K and V once (a replicated KV head too)."""
    spec, reader = source.open()
    element = torch.empty(0, dtype=getattr(torch, opts.dtype)).element_size()
    sizes = {n: float(np.prod(reader.shape(n))) * element for n in reader.names()
             if not (n == "lm_head" and spec.tie_word_embeddings)}
    return resident_traffic(spec, sizes, kv_layer_bytes(spec, element))


def _wait_ready(procs: list[Any], conns: list[Connection], timeout_s: float) -> None:
    waiting = dict(zip(conns, range(1, len(procs) + 1), strict=True))
    deadline = time.monotonic() + timeout_s
    while waiting:
        for ready in wait(list(waiting), timeout=1.0):
            conn = cast(Connection, ready)
            rank = waiting.pop(conn)
            try:
                status, message = conn.recv()
            except EOFError:
                status, message = "error", f"exited with code {procs[rank - 1].exitcode}"
            if status != "ready":
                raise BackendUnavailable(f"parallel worker rank {rank} failed to load its shard: {message}")
        for rank in list(waiting.values()):
            if not procs[rank - 1].is_alive():
                raise BackendUnavailable(f"parallel worker rank {rank} exited with code {procs[rank - 1].exitcode} "
                                         "before loading its shard")
        if time.monotonic() > deadline:
            raise BackendUnavailable(f"parallel workers {sorted(waiting.values())} did not load within {timeout_s:.0f}s")


def from_torchrun(source: WeightSource, config: ParallelConfig, opts: RunOptions) -> DistributedRunner:
    """Connect a rank started by `torchrun`. Rank 0 returns its runner; other ranks serve steps, then exit."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != config.world_size:
        raise BackendUnavailable(f"torchrun started {world} processes but {config.describe()} needs "
                                 f"{config.world_size}: set --nnodes x --nproc-per-node to {config.world_size}")
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    is_master = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    store = make_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master, opts.timeout_s)
    model = build_shard(source, config, rank, opts, local_rank)
    model.connect(join_groups(store, model.pos, model.ops.device, opts.timeout_s))
    if rank == 0:
        runner = DistributedRunner(model, opts.kv, [], store)
        runner.traffic = whole_model_traffic(source, opts)
        return runner
    try:
        serve_steps(model)
    finally:
        for comm in model.comms.values():
            comm.shutdown()
    sys.exit(0)


def under_torchrun() -> bool:
    """Whether this process was started by torchrun (or another launcher that sets RANK/WORLD_SIZE)."""
    return "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1


def open_parallel(path: Path, spec: ModelSpec, degrees: tuple[int, int, int], *, ctx: int, threads: int | None,
                  dtype: str | None, device: str | None) -> DistributedRunner:
    """`open_model`'s entry: (tp, ep, pp) ranks for the model at `path`, spawned here or joined under torchrun."""
    tp, ep, pp = degrees
    config = ParallelConfig(tp=tp, ep=ep, pp=pp)
    config.check(spec)
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    kind = "cuda" if dev.startswith("cuda") else "cpu"
    per_rank = max(1, (threads or os.cpu_count() or 1) // config.world_size)
    opts = RunOptions(device=kind, dtype=dtype or ("bfloat16" if kind == "cuda" else "float32"), kv_tokens=ctx,
                      threads=per_rank)
    source = WeightSource(path=str(path))
    return from_torchrun(source, config, opts) if under_torchrun() else launch(source, config, opts)
