"""Qwen3: Llama's decoder with per-head RMSNorm on queries and keys (`spec.qk_norm`), no biases."""

from twinfer.runtime.models.base import Model as _Decoder


class Model(_Decoder):
    pass
