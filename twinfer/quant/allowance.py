"""How far two faithful runs of one model may differ: the kernel floor, the allowance over it, the verdict.

A kernel floor is the mean KL between two faithful kernel paths of the reference (llama.cpp repacked vs
as stored), or a declared class (`DECLARED`). Verdicts: `faithful`, `within kernel noise`, `degraded`;
read by `twinfer doctor` and `twinfer eval kl`."""

from __future__ import annotations

from dataclasses import dataclass

FAITHFUL_KL = 1e-3  # mean KL at or below which a candidate computes what the reference computes
NOISE_MARGIN = 1.6  # a floor measured on a few hundred tokens moves run to run; 0.0063 allows 0.01

FAITHFUL, NOISE, DEGRADED = "faithful", "within kernel noise", "degraded"
VERDICTS = (FAITHFUL, NOISE, DEGRADED)


@dataclass(frozen=True)
class KernelFloor:
    """Mean KL between two faithful kernel paths of one model, and where that number came from."""

    kl: float
    source: str  # "measured: ..." or "declared: ..."

    @property
    def allowance(self) -> float:
        """The largest mean KL still within kernel noise."""
        return self.kl * NOISE_MARGIN

    def line(self) -> str:
        return (f"kernel floor {self.kl:.2e} ({self.source}); within kernel noise up to {self.allowance:.2e} "
                f"({NOISE_MARGIN:g}x)")


# llama.cpp's CPU matmuls quantize activations to 8 bits; this floor is the default model's mean KL against
# fp32 on the same weights (`twinfer doctor`)
LLAMA_CPP_CPU = KernelFloor(0.0063, "declared: llama.cpp CPU kernels, 8-bit activations in their matmuls, "
                                    "measured against fp32 on Gemma 3 270M Q4_K_M by twinfer doctor")
DECLARED: dict[str, KernelFloor] = {"llama.cpp CPU kernels": LLAMA_CPP_CPU}


def verdict(mean_kl: float, floor: KernelFloor, faithful_kl: float = FAITHFUL_KL) -> str:
    """`faithful` up to `faithful_kl` (never above the allowance), `within kernel noise` up to the
    floor's allowance, else `degraded`."""
    if mean_kl <= min(faithful_kl, floor.allowance):
        return FAITHFUL
    return NOISE if mean_kl <= floor.allowance else DEGRADED


def verdict_line(mean_kl: float, floor: KernelFloor, faithful_kl: float = FAITHFUL_KL,
                 what: str = "the endpoint") -> str:
    """One line a user can act on; a degraded verdict starts with FLAGGED."""
    v = verdict(mean_kl, floor, faithful_kl)
    if v == FAITHFUL:
        return f"faithful: mean KL {mean_kl:.2e} <= {min(faithful_kl, floor.allowance):.2g}"
    if v == NOISE:
        return (f"within kernel noise: mean KL {mean_kl:.2e} <= {floor.allowance:.2e}, no further from the "
                "reference than another faithful kernel path of the same model")
    return (f"FLAGGED: mean KL {mean_kl:.2e} > {floor.allowance:.2e} ({NOISE_MARGIN:g}x the kernel floor "
            f"{floor.kl:.2e}): degraded: {what} does not serve this model faithfully")


def llamacpp_mode(spec: str) -> str | None:
    """The llama.cpp run mode a reference SPEC runs in (`llamacpp` or `llamacpp:...`), None for any other."""
    backend, _, rest = spec.partition(":")
    if backend != "llamacpp":
        return None
    options = dict(item.partition("=")[::2] for item in filter(None, rest.split(",")))
    return options.get("mode", "row-invariant")


def other_kernels(spec: str) -> tuple[str, str] | None:
    """(the SPEC of the reference's other faithful kernel path, what differs), or None where there is none
    to run here: llama.cpp with weights as stored against repacked, or repacked against as stored."""
    mode = llamacpp_mode(spec)
    if mode is None:
        return None
    other = "row-invariant" if mode == "fast" else "fast"
    backend, _, rest = spec.partition(":")
    items = [i for i in filter(None, rest.split(",")) if not i.startswith("mode=")] + [f"mode={other}"]
    return f"{backend}:{','.join(items)}", "llama.cpp with weights repacked vs as stored"


def kernels_line(spec: str) -> str:
    """What the reference runs, and what `twinfer serve` runs at its defaults, so a reader sees a difference."""
    mode = llamacpp_mode(spec)
    if mode is None:
        return f"reference kernels: {spec}; a twinfer server of a GGUF runs llama.cpp's"
    if mode == "fast":
        return "reference kernels: llama.cpp, weights repacked, as `twinfer serve` runs them by default"
    return ("reference kernels: llama.cpp, weights as stored; `twinfer serve` repacks them by default (kernels "
            "differ from such a server: expect the kernel floor; --reference llamacpp:mode=fast matches it)")
