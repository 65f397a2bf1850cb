"""Mixtral: Mistral attention with 8 SiLU experts, top-2.

Mixtral takes softmax over the top-k router logits, which equals softmax over all experts followed by
renormalizing the kept k, so its spec sets `norm_topk_prob=True` and shares `Ops.moe` with Qwen3-MoE.
"""

from twinfer.runtime.models.base import Model as _Decoder


class Model(_Decoder):
    pass
