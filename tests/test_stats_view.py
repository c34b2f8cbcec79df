"""The stats panel (components/stats.py)."""

from __future__ import annotations

from app.serving.sessions import MB, StoreStats
from components.stats import stats_markdown


def test_stats_markdown():
    store = StoreStats(sessions=2, kv_bytes=3 * MB, budget_bytes=512 * MB, shared_bytes=MB // 2)
    assert "no tokens yet" in stats_markdown(None, store)
    assert "Server: 2 sessions, 3.0 MB of KV + 0.5 MB of shared prompts (budget 512 MB)" in stats_markdown(None, store)


def test_the_panel_names_the_adapter_and_the_run_that_trained_it():
    from app.backends.base import BackendStats

    store = StoreStats(sessions=0, kv_bytes=0, budget_bytes=512 * MB, shared_bytes=0)
    tuned = BackendStats("in-process (m + adapter 0123456789ab, int8)", kv_in_process=True,
                         adapter="adapter 0123456789ab, trained by python3 scripts/train.py at d8ed277")
    shown = stats_markdown(None, store, tuned)
    assert "Weights: base + LoRA adapter adapter 0123456789ab, trained by python3 scripts/train.py at d8ed277" in shown
    assert "Weights:" not in stats_markdown(None, store, BackendStats("in-process (m, int8)", kv_in_process=True))
