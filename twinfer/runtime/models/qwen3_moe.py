"""Qwen3-MoE: Qwen3 attention (QK-norm) with a routed-expert feed-forward.

Router: softmax over all experts, keep the top k, renormalize when `moe.norm_topk_prob`.
The feed-forward dispatch is `Ops.moe`, which a backend may fuse.
"""

from twinfer.runtime.models.base import Model as _Decoder


class Model(_Decoder):
    pass
