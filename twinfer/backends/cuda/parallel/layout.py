"""Where each rank sits: a grid of `pp` pipeline stages, each `ep` expert groups of `tp` tensor ranks;
rank = (stage * ep + expert_group) * tp + tp_rank, and rank 0 runs the engine (docs/parallelism.md)."""

from __future__ import annotations

from dataclasses import dataclass

from twinfer.runtime.errors import PlanError
from twinfer.runtime.spec import ModelSpec

EP_DISPATCH = ("auto", "all_reduce", "all_to_all")
A2A_MIN_TOKENS = 256  # below this a step's MoE combine is latency-bound: one all-reduce wins


@dataclass(frozen=True)
class ParallelConfig:
    """Degrees of tensor, expert and pipeline parallelism; world size is their product."""

    tp: int = 1
    ep: int = 1
    pp: int = 1
    micro_batches: int = 0  # pipeline micro-batches per step (0: one per stage)
    ep_dispatch: str = "auto"  # MoE combine: "all_reduce", "all_to_all" or "auto" (see ep_all_to_all)

    def __post_init__(self) -> None:
        for name in ("tp", "ep", "pp"):
            if getattr(self, name) < 1:
                raise PlanError(f"--{name} must be at least 1, got {getattr(self, name)}")
        if self.micro_batches < 0:
            raise PlanError(f"micro_batches must be >= 0, got {self.micro_batches}")
        if self.ep_dispatch not in EP_DISPATCH:
            raise PlanError(f"ep_dispatch {self.ep_dispatch!r} is not one of {', '.join(EP_DISPATCH)}")

    def ep_all_to_all(self, num_tokens: int, top_k: int) -> bool:
        """Whether a MoE layer over `num_tokens` tokens dispatches by all-to-all instead of one all-reduce:
        "auto" takes it only where it moves fewer bytes (n > 2 k tp) and the step is large enough for
        bytes, not latency, to decide (docs/parallelism.md)."""
        if self.stage_size == 1 or self.ep_dispatch == "all_reduce" or num_tokens == 0:
            return False
        if self.ep_dispatch == "all_to_all":
            return True
        return num_tokens >= A2A_MIN_TOKENS and self.stage_size > 2 * top_k * self.tp

    @property
    def world_size(self) -> int:
        return self.tp * self.ep * self.pp

    @property
    def stage_size(self) -> int:
        return self.tp * self.ep

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1

    def describe(self) -> str:
        extra = f" ep_dispatch={self.ep_dispatch}" if self.ep_dispatch != "auto" else ""
        return f"tp={self.tp} ep={self.ep} pp={self.pp}{extra}"

    def check(self, spec: ModelSpec) -> None:
        """Raise PlanError when `spec` cannot be split this way, saying which dimension does not divide."""
        s, tp = spec, self.tp
        if s.num_heads % tp:
            raise PlanError(f"--tp {tp} does not divide the model's {s.num_heads} attention heads")
        for kv in {s.num_kv_heads, s.global_kv_heads or s.num_kv_heads}:
            if kv % tp and tp % kv:
                raise PlanError(f"--tp {tp} and the model's {kv} KV heads: one must divide the other")
        if s.linear_attn is not None and s.linear_attn.num_k_heads % tp:
            raise PlanError(f"--tp {tp} does not divide the model's {s.linear_attn.num_k_heads} linear-attention "
                            "key heads")
        if s.vocab_size % tp:
            raise PlanError(f"--tp {tp} does not divide the vocabulary of {s.vocab_size} tokens")
        dense = s.moe is None or s.moe.first_dense_layers > 0
        if dense and s.intermediate_size % tp:
            raise PlanError(f"--tp {tp} does not divide the MLP width {s.intermediate_size}")
        if self.ep > 1 and s.moe is None:
            raise PlanError(f"--ep {self.ep} needs a mixture-of-experts model; {s.model_type} has no experts")
        if s.moe is not None:
            if s.moe.num_experts % self.ep:
                raise PlanError(f"--ep {self.ep} does not divide the model's {s.moe.num_experts} experts")
            if s.moe.expert_intermediate_size % tp:
                raise PlanError(f"--tp {tp} does not divide the expert width {s.moe.expert_intermediate_size}")
            if s.moe.shared_intermediate_size % tp:
                raise PlanError(f"--tp {tp} does not divide the shared experts' width {s.moe.shared_intermediate_size}")
        if self.pp > s.num_layers:
            raise PlanError(f"--pp {self.pp} is more stages than the model's {s.num_layers} layers")


@dataclass(frozen=True)
class RankPosition:
    """One rank's coordinates in the grid, and the layers its stage owns."""

    config: ParallelConfig
    rank: int
    num_layers: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.config.world_size:
            raise PlanError(f"rank {self.rank} is outside a world of {self.config.world_size}")

    @property
    def stage(self) -> int:
        return self.rank // self.config.stage_size

    @property
    def expert_group(self) -> int:
        return (self.rank // self.config.tp) % self.config.ep

    @property
    def tp_rank(self) -> int:
        return self.rank % self.config.tp

    @property
    def first_stage(self) -> bool:
        return self.stage == 0

    @property
    def last_stage(self) -> bool:
        return self.stage == self.config.pp - 1

    @property
    def layers(self) -> range:
        """Contiguous layers of this stage; earlier stages take the remainder one each."""
        return stage_layers(self.num_layers, self.config.pp, self.stage)

    def rank_of(self, stage: int, expert_group: int, tp_rank: int) -> int:
        c = self.config
        return (stage * c.ep + expert_group) * c.tp + tp_rank

    @property
    def tp_group_ranks(self) -> list[int]:
        return [self.rank_of(self.stage, self.expert_group, t) for t in range(self.config.tp)]

    @property
    def stage_ranks(self) -> list[int]:
        return [self.rank_of(self.stage, e, t) for e in range(self.config.ep) for t in range(self.config.tp)]

    def peer_in(self, stage: int) -> int:
        """The rank with this rank's (expert group, tp rank) in another stage: pipeline neighbours."""
        return self.rank_of(stage, self.expert_group, self.tp_rank)


def stage_layers(num_layers: int, pp: int, stage: int) -> range:
    base, extra = divmod(num_layers, pp)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))
