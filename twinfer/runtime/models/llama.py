"""Llama 2/3 and Mistral: the plain pre-norm decoder of `base.Model`, SiLU-gated MLP, NeoX rope.

Llama 3's rope frequency scaling comes from the spec (see runtime/rope.py).
"""

from twinfer.runtime.models.base import Model as _Decoder


class Model(_Decoder):
    pass
