"""The application layer: open a model the way the user asked, in one place (`session.py`): resolve,
plan under a budget, transform, open the runner, add a proposer, build engines. It knows every layer."""

from __future__ import annotations

from twinfer.app.session import OpenOptions, Session, open_session

__all__ = ["OpenOptions", "Session", "open_session"]
