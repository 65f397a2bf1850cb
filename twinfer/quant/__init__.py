"""Weight and KV-cache compression: formats, TurboQuant, and the registry the planner reads.

Everything here is numpy only; backends import the layouts documented in each module.

* ``affine``: int8/int4 groups in MLX's layout;   ``fp8``: E4M3 per tensor and 128x128 blocks;
* ``nvfp4``: E2M1 + E4M3 block scales + FP32 global; ``mxfp4``: E2M1 + E8M0, gpt-oss loading;
* ``turboquant`` (+ ``hadamard``, ``lloyd_max``, ``qjl``, ``turboquant_kv``, ``turboquant_weight``);
* ``linear``: the QuantizedWeight container backends run; ``kv_format``: KV-cache formats;
* ``model_io``: quantized views and folders; ``search``: per-tensor formats by measured KL.
"""

from twinfer.quant.registry import FORMAT_INFO, FORMATS, HARDWARE_FAMILIES, FormatInfo, native_on, pack_weight
from twinfer.quant.turboquant import TQCodes, TQTensor, TurboQuant, TurboQuantMSE, choose_outliers
from twinfer.quant.turboquant_kv import TurboQuantKV
from twinfer.quant.turboquant_weight import TQWeight, turboquant_weight

__all__ = [
    "FORMATS",
    "FORMAT_INFO",
    "HARDWARE_FAMILIES",
    "FormatInfo",
    "native_on",
    "pack_weight",
    "TQCodes",
    "TQTensor",
    "TQWeight",
    "TurboQuant",
    "TurboQuantKV",
    "TurboQuantMSE",
    "choose_outliers",
    "turboquant_weight",
]
