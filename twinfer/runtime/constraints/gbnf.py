"""GBNF (llama.cpp's grammar format) to Lark, through llguidance's converter."""

from __future__ import annotations

from twinfer.runtime.constraints.spec import GrammarError


def to_lark(gbnf: str) -> str:
    """The Lark form of a GBNF grammar (a Lark grammar passes through unchanged)."""
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        return str(any_to_lark(gbnf))
    except Exception as e:  # noqa: BLE001 - the converter raises plain exceptions on bad input
        raise GrammarError(f"the GBNF grammar cannot be read: {e}") from e
