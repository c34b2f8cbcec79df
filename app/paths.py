"""Where things live: the repository root, the bundled assets, and the local cache folder (TEXTENV_CACHE_DIR, by
default ~/.cache/textenv-chat) for converted weights, built indexes and compiled kernels."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ASSETS = ROOT / "assets"


def cache_dir() -> Path:
    """Where converted weights and built indexes live (outside git, reused across starts)."""
    path = Path(os.environ.get("TEXTENV_CACHE_DIR", Path.home() / ".cache" / "textenv-chat"))
    path.mkdir(parents=True, exist_ok=True)
    return path
