"""What each engine runs: the planner's copy of the runtime's refusals, so a plan never names a strategy
(architecture x format x engine x parallelism) that the runner it names would refuse. Each rule names
the runtime place it mirrors."""

from __future__ import annotations

from twinfer.planners.cost import Strategy, _native
from twinfer.planners.hardware import GPU, Device
from twinfer.planners.model import ModelProfile

DENSE_KV = frozenset({"f32", "bf16", "f16"})  # the torch/MLX runners' KV in their own dtype
LLAMACPP_KV = frozenset({"f16", "q8_0", "q4_0"})
ENGINES = ("llamacpp", "torch", "mlx")
CONVERTED = frozenset({"f32", "bf16", "f16", "fp8"})  # what the torch runner turns float weights into itself


def refusal(profile: ModelProfile, s: Strategy, device: Device) -> str:
    """Why the engine `s` names would refuse to run `profile`'s model this way ("" when it runs it)."""
    spec, kv = profile.spec, s.kv.name
    if s.engine not in ENGINES:
        return f"no runner named {s.engine!r}"
    if s.engine == "llamacpp":
        if "llamacpp" not in s.mix.engines:
            return f"the llama.cpp runner loads GGUF files, not {s.mix.label or s.mix.name} weights"
        if kv not in LLAMACPP_KV:
            return f"the llama.cpp runner's cache holds F16, Q8_0 or Q4_0, not {s.kv.label}"
        return ""
    turboquant = s.kv.family == "turboquant"
    if kv not in DENSE_KV and not turboquant:
        return f"the {s.engine} runner keeps KV in its dtype or TurboQuant codes, not {s.kv.label}"
    if turboquant and spec.mla is not None:
        return "latent attention (MLA) does not run on a TurboQuant KV cache"
    if turboquant and spec.attention_sinks:
        return "attention sinks do not run on a TurboQuant KV cache"
    if turboquant and spec.kv_shared_layers:
        return "layers that share KV (Gemma 4's last layers) do not run on a TurboQuant KV cache"
    if s.engine == "torch":
        published = s.mix.name == profile.native or s.mix is profile.stored
        formats = set() if published else s.mix.formats() - CONVERTED
        if device.kind == GPU:
            formats = {f for f in s.mix.formats() - {"f32"} if not _native(device, f)} | (
                set() if published else formats - {f for f in formats if _native(device, f)})
        if formats:
            return f"the torch runner does not hold {', '.join(sorted(formats))} weights on {device.label}"
    return ""

