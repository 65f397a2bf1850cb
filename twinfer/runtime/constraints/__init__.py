"""Structured output: grammars (JSON Schema, regex, choice, Lark, GBNF) compiled with llguidance into
per-row allowed-token masks that the sampler applies before it draws.

- `Constraint` (spec.py): what the output must match, as plain data;
- `Grammars` (compile.py): compiles constraints for one tokenizer, cached, with a time limit;
- `Guide` and the mask functions (mask.py): one request's grammar state and a step's masks.
llguidance is imported only when a grammar is first compiled.
"""

from twinfer.runtime.constraints.compile import ConstraintStats, Grammars
from twinfer.runtime.constraints.spec import Constraint, GrammarError

__all__ = ["Constraint", "ConstraintStats", "GrammarError", "Grammars"]
