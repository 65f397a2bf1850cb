"""The application layer: open a model the way the user asked, in one place.

Above planners, quant and backends, below the faces (cli, tui, server start-up, bench): resolve a
model, plan it under a memory budget, transform it (requantize, prune), open its runner, add a
speculative proposer, build engines (`session.py`). It is the one layer that knows every other.
"""

from __future__ import annotations

from twinfer.app.session import OpenOptions, Session, open_session

__all__ = ["OpenOptions", "Session", "open_session"]
