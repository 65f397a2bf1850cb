"""Number formats, written once: element tables and codecs that quant, the loaders, the models and the
backends all read.

A leaf: numpy only, importing nothing else from twinfer, so every layer (the core included) may import it.

* `e2m1`: FP4 E2M1, the element of MXFP4 and NVFP4; `fp8`: FP8 E4M3 (its table, codec and the per-tensor /
  per-channel / block-scaled weight layouts); `e8m0`: MXFP4's power-of-two block scale;
* `mxfp4`, `nvfp4`: the block formats built from them; `bitpack`: b-bit codes <-> bytes (nibbles low first).
"""
