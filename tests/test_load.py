"""The load test's small version: several API clients at once against the real app, on loopback, with a KV
budget small enough that sessions lose their caches between turns (benchmarks/load_test.py has the full one)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_four_clients_at_once_get_their_own_answers_without_errors():
    """With the default budget the clients' turns share forward passes; with a budget below the shared prompts'
    keys/values alone, sessions lose their caches between turns and the turns run one at a time, so the KV held
    stays at the shared prompts plus one running session."""
    out = subprocess.run([sys.executable, "benchmarks/load_test.py", "--sessions", "4", "--turns", "2",
                          "--budgets", "default", "8", "--json"], cwd=ROOT, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    roomy, small = (json.loads(line) for line in out.stdout.strip().splitlines()[-2:])
    for result in (roomy, small):
        assert result["errors"] == 0 and result["solo_errors"] == 0, result["error_samples"]
        assert result["leaks"] == 0  # no answer holds another session's numbers
        assert result["tracebacks"] == 0
        assert result["answered"] == 8 and result["own"] >= 6, result["wrong_samples"]  # (the model errs on x * 10)
    assert roomy["scheduler"]["peak_rows"] >= 2  # the clients' segments shared forward passes
    assert roomy["kv_peak_mb"] <= roomy["budget_mb"]
    assert small["budget_mb"] == 8.0
    assert small["scheduler"]["peak_rows"] == 1  # one turn at a time: the budget is spent
    assert small["kv_peak_mb"] <= small["shared_mb"] + 12  # the shared prompts and one running session
