"""The stats panel (components/stats.py)."""

from __future__ import annotations

from app.serving.sessions import MB, StoreStats
from components.stats import stats_markdown


def test_stats_markdown():
    store = StoreStats(sessions=2, kv_bytes=3 * MB, budget_bytes=512 * MB, shared_bytes=MB // 2)
    assert "no tokens yet" in stats_markdown(None, store)
    assert "Server: 2 sessions, 3.0 MB of KV + 0.5 MB of shared prompts (budget 512 MB)" in stats_markdown(None, store)
