"""The engine: continuous batching over any Runner, with sampling, the loop guard and streaming."""

from twinfer.runtime.engine.engine import Engine, EngineConfig
from twinfer.runtime.engine.params import GuardConfig, SamplingParams
from twinfer.runtime.engine.request import RequestOutput

__all__ = ["Engine", "EngineConfig", "GuardConfig", "RequestOutput", "SamplingParams"]
