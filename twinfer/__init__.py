"""twinfer: one LLM inference runtime with two targets (local laptops and datacenter GPUs)."""

__version__ = "0.1.0"
