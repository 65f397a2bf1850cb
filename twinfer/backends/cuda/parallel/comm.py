"""Process groups without global state: gloo or NCCL groups built straight from a TCPStore, one per set
of ranks that talk, so two engines can live in one process. A group of one rank does nothing."""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist


class Comm:
    """Collectives over one group of ranks; `ranks[i]` is global rank of group rank i."""

    def __init__(self, pg: Any, ranks: Sequence[int], rank: int):
        self.pg = pg
        self.ranks = list(ranks)
        self.rank = self.ranks.index(rank)  # this process's index in the group

    @property
    def size(self) -> int:
        return len(self.ranks)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the group in place; returns it."""
        if self.pg is not None:
            self.pg.allreduce([t]).wait()
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `t` along `dim`, in group order."""
        if self.pg is None:
            return t
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in self.ranks]
        self.pg.allgather([parts], [t]).wait()
        return torch.cat(parts, dim=dim)

    def all_to_all(self, out: torch.Tensor, t: torch.Tensor, out_splits: list[int], in_splits: list[int]
                   ) -> torch.Tensor:
        """Send rows in_splits[i] of `t` (in order) to group rank i; receive out_splits[i] rows from each into `out`."""
        if self.pg is None:
            return out.copy_(t)
        self.pg.alltoall_base(out, t.contiguous(), out_splits, in_splits, dist.AllToAllOptions()).wait()
        return out

    def broadcast(self, t: torch.Tensor, root: int = 0) -> torch.Tensor:
        """Overwrite `t` with group rank `root`'s copy."""
        if self.pg is not None:
            self.pg.broadcast(t, root).wait()
        return t

    def send(self, t: torch.Tensor, dst: int, tag: int = 0) -> dist.Work:
        """Start sending contiguous `t` to group rank `dst`; keep `t` alive until the returned work is waited on."""
        assert self.pg is not None and t.is_contiguous()
        return self.pg.send([t], dst, tag)

    def recv(self, t: torch.Tensor, src: int, tag: int = 0) -> torch.Tensor:
        """Receive into `t` from group rank `src` (blocks)."""
        assert self.pg is not None
        self.pg.recv([t], src, tag).wait()
        return t

    def shutdown(self) -> None:
        if self.pg is not None and hasattr(self.pg, "shutdown"):
            with contextlib.suppress(RuntimeError):
                self.pg.shutdown()
            self.pg = None


def make_store(host: str, port: int, world_size: int, is_master: bool, timeout_s: float) -> dist.TCPStore:
    """The rendezvous store: rank 0 listens (port 0 picks a free port, read it from `.port`)."""
    return dist.TCPStore(host, port, world_size, is_master, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def make_comm(store: dist.Store, name: str, ranks: Sequence[int], rank: int, device: torch.device,
              timeout_s: float) -> Comm:
    """Join the group `name` of `ranks` (every member calls this with the same arguments)."""
    if len(ranks) == 1:
        return Comm(None, ranks, rank)
    prefix = dist.PrefixStore(f"twinfer/{name}", store)
    index = list(ranks).index(rank)
    timeout = datetime.timedelta(seconds=timeout_s)
    pg: Any  # a ProcessGroupGloo or ProcessGroupNCCL backend object
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(prefix, index, len(ranks), opts)
    else:
        pg = dist.ProcessGroupGloo(prefix, index, len(ranks), timeout)
    return Comm(pg, ranks, rank)
