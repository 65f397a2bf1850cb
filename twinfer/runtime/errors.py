"""User-facing errors: each one carries a message that says what was wrong and what to do.
The CLI prints a `TwinferError` as one line and exits non-zero; anything else is a bug and keeps its
traceback."""

from __future__ import annotations

import importlib


class TwinferError(Exception):
    """Base class of errors caused by the user's input or environment, not by a twinfer bug; `field` names
    the option or request field concerned (the server's `param`)."""

    exit_code = 2

    def __init__(self, *args: object, field: str | None = None) -> None:
        super().__init__(*args)
        self.field = field


class ModelError(TwinferError):
    """A model path, file or architecture twinfer cannot use."""


class UnsupportedArchitecture(ModelError):
    """The model's architecture (`model_type`) has no model file in twinfer/runtime/models."""


class WeightError(ModelError):
    """A tensor is missing, unused, or has the wrong shape."""


class BackendUnavailable(TwinferError):
    """The requested backend's library is not installed or cannot run here."""


class OptionError(TwinferError):
    """A command's option (an options object's `field`) outside what it may be."""


class RequestError(TwinferError):
    """A generation request with invalid parameters."""


class PlanError(TwinferError):
    """A plan that does not fit, or planner input that makes no sense."""


class MissingPackage(TwinferError):
    """An optional package a command needs is not installed."""


# The extra of twinfer's pyproject that brings each optional module, and the pip name where it differs.
EXTRAS = {"torch": ("cuda", "torch"), "triton": ("cuda", "triton"), "mlx": ("metal", "mlx"),
          "transformers": ("reference", "transformers"), "accelerate": ("reference", "accelerate"),
          "llama_cpp": (None, "llama-cpp-python"), "llguidance": (None, "llguidance"), "PIL": (None, "pillow")}


def require(purpose: str, *modules: str) -> None:
    """Raise one line naming the first of `modules` that does not import, and how to install it."""
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError:
            extra, pip_name = EXTRAS.get(module, (None, module))
            how = f"pip install 'twinfer[{extra}]'" if extra else f"pip install {pip_name}"
            raise MissingPackage(f"{purpose} needs the {pip_name} package, which is not installed: {how}") from None
