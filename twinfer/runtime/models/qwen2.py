"""Qwen2: Llama's decoder with biases on the Q, K and V projections (`q_bias`, `k_bias`, `v_bias`).

The biases ride in `base.Model.attention` through `w.get(...)`; nothing else differs.
"""

from twinfer.runtime.models.base import Model as _Decoder


class Model(_Decoder):
    pass
