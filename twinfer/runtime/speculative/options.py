"""`--speculate {off,ngram,draft:PATH,self:N}`: parse the option (the app layer builds the proposer)."""

from __future__ import annotations

from twinfer.runtime.errors import TwinferError

CHOICES = "off, ngram, draft:PATH or self:N"


def parse_speculate(value: str) -> tuple[str, str]:
    """("off" | "ngram" | "draft" | "self", argument) from the option's text."""
    kind, _, arg = value.strip().partition(":")
    if kind in ("off", "ngram") and not arg:
        return kind, ""
    if kind == "draft" and arg:
        return kind, arg
    if kind == "self" and arg.isdigit() and int(arg) > 0:
        return kind, arg
    raise TwinferError(f"--speculate {value!r}: choose {CHOICES} (e.g. draft:small.gguf, self:4)")
