"""Weight and KV-cache compression: TurboQuant, the registry the planner reads, and the measuring harness.

Everything here is numpy only; backends import the layouts documented in each module. The published
formats (FP8, NVFP4, MXFP4 and their element types) are written once in `twinfer.formats`.

* ``affine``: int8/int4 groups in MLX's layout;
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
