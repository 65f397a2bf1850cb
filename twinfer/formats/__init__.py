"""Number formats, written once: E2M1, FP8 E4M3, E8M0 element tables and the MXFP4, NVFP4 and FP8 weight
layouts, plus bit packing. A leaf: numpy only, importable from every layer."""
