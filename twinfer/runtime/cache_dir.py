"""Where twinfer keeps what it derives from model files (converted tokenizers, requantized and pruned models)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(kind: str) -> Path:
    """`$TWINFER_CACHE/<kind>` when set, else `<user cache dir>/twinfer/<kind>` (~/.cache/twinfer on Linux)."""
    root = os.environ.get("TWINFER_CACHE")
    if root:
        return Path(root).expanduser() / kind
    import platformdirs

    return Path(platformdirs.user_cache_dir("twinfer")) / kind
