"""llama.cpp whole-model runner (GGUF files on any CPU, or Metal/CUDA builds of llama.cpp).
Importing this package is cheap: `llama_cpp` is imported when the first runner is built."""

from twinfer.backends.llamacpp.options import LlamaCppOptions, RunMode, options_for_mode
from twinfer.backends.llamacpp.runner import BLOCK_SIZE, DecodeError, KVCacheFull, LlamaCppRunner

__all__ = ["BLOCK_SIZE", "DecodeError", "KVCacheFull", "LlamaCppOptions", "LlamaCppRunner", "RunMode",
           "options_for_mode"]
