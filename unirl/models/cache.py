"""Where unirl builds and caches its local artefacts (the tiny models of the demos and tests)."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """``$UNIRL_CACHE``, else ``$XDG_CACHE_HOME/unirl``, else ``~/.cache/unirl``."""
    root = os.environ.get("UNIRL_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"), "unirl")
    return Path(root)
