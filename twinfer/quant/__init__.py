"""Weight and KV-cache compression: TurboQuant, the format registry, pruning and the KL harness.
numpy only; backends import the layouts each module documents (docs/quantization.md, "Layouts")."""

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
