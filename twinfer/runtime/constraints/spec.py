"""What a request may generate: a `Constraint` is a grammar kind (`json_schema`, `json_object`, `regex`,
`choice`, `lark`, `gbnf`, `llguidance`) and its text as the user sent it; `Grammars` compiles it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from twinfer.runtime.errors import RequestError

KINDS = ("json_schema", "json_object", "regex", "choice", "lark", "gbnf", "llguidance")
MAX_TEXT_CHARS = 1 << 20
# JSON without free whitespace, in json.dumps' default spacing, and strings without \u escapes: a
# small model would otherwise loop on blanks or on escape sequences (Gemma 3 270M does).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
                "json_allowed_escapes": 'nt"\\'}


# An integer a schema leaves unbounded is held to I-JSON's exact range (RFC 7493: what every JSON parser
# reads without loss), so its digits end: small models otherwise write digits until max_tokens.
SAFE_INTEGERS = (-(2**53 - 1), 2**53 - 1)
_DATA_KEYS = ("const", "enum", "default", "examples")  # values here are data, not schemas


def bounded_integers(schema: Any) -> Any:
    """`schema` with SAFE_INTEGERS bounds on every integer that has none (a copy; the input is unchanged)."""
    if isinstance(schema, list):
        return [bounded_integers(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in _DATA_KEYS else bounded_integers(v) for k, v in schema.items()}
    kinds = out.get("type")
    if kinds == "integer" or (isinstance(kinds, list) and "integer" in kinds):
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = SAFE_INTEGERS[0]
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = SAFE_INTEGERS[1]
    return out


class GrammarError(RequestError):
    """A constraint that cannot be compiled (bad schema or grammar, or over the time limit)."""


@dataclass(frozen=True)
class Constraint:
    """A grammar the output must match: `kind` (one of KINDS) and its source `text`."""

    kind: str
    text: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise GrammarError(f"unknown constraint kind {self.kind!r}; use one of {', '.join(KINDS)}")
        if not isinstance(self.text, str):
            raise GrammarError(f"a {self.kind} constraint needs text, got {type(self.text).__name__}")
        if len(self.text) > MAX_TEXT_CHARS:
            raise GrammarError(f"the {self.kind} constraint is longer than {MAX_TEXT_CHARS} characters")

    @classmethod
    def json_schema(cls, schema: Any) -> Constraint:
        """A JSON Schema given as a dict (or bool) or as JSON text."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise GrammarError(f"the JSON schema is not valid JSON: {e}") from e
        if not isinstance(schema, (dict, bool)):
            raise GrammarError(f"a JSON schema must be an object, got {type(schema).__name__}")
        return cls("json_schema", json.dumps(schema))  # key order kept: properties come out in it

    @classmethod
    def choice(cls, options: Any) -> Constraint:
        if not isinstance(options, list) or not options or not all(isinstance(o, str) for o in options):
            raise GrammarError("a choice constraint needs a non-empty list of strings")
        return cls("choice", json.dumps(options))

    def grammar(self) -> str:
        """The llguidance grammar of this constraint (llguidance is imported here, lazily)."""
        import llguidance

        from twinfer.runtime.constraints.gbnf import to_lark

        m = llguidance.LLMatcher
        try:
            if self.kind == "json_schema":
                schema = json.dumps(bounded_integers(json.loads(self.text)))
                return m.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)  # type: ignore[arg-type]
            if self.kind == "json_object":
                return m.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)  # type: ignore[arg-type]
            if self.kind == "regex":
                return m.grammar_from_regex(self.text)
            if self.kind == "choice":
                options = json.loads(self.text)
                return m.grammar_from_lark("start: " + " | ".join(json.dumps(o) for o in options))
            if self.kind == "lark":
                return m.grammar_from_lark(self.text)
            if self.kind == "gbnf":
                return m.grammar_from_lark(to_lark(self.text))
        except ValueError as e:
            raise GrammarError(f"the {self.kind} constraint is invalid: {e}") from e
        return self.text  # llguidance
