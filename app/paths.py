"""Settings read from environment variables, with defaults that work offline on a fresh machine."""

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
