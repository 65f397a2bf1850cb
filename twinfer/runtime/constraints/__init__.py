"""Structured output: grammars compiled with llguidance into per-row allowed-token masks the sampler
applies. `Constraint` (spec.py) is the data, `Grammars` (compile.py) compiles, `Guide` (mask.py) runs;
llguidance is imported only when a grammar is first compiled."""

from twinfer.runtime.constraints.compile import ConstraintStats, Grammars
from twinfer.runtime.constraints.spec import Constraint, GrammarError

__all__ = ["Constraint", "ConstraintStats", "GrammarError", "Grammars"]
