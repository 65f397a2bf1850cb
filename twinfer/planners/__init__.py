"""The planner: from hardware numbers and a model's architecture to a strategy, a speed and the reasons.
Everything here except probe.py (and llamacpp_build.py) is pure arithmetic and imports nothing heavy,
so `twinfer plan` starts fast (docs/architecture.md, "The planner's cost model")."""
