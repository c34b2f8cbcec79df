"""The load test's small version: several API clients at once against the real app, on loopback, with a KV
budget small enough that sessions lose their caches between turns (benchmarks/load_test.py has the full one)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_four_clients_at_once_get_their_own_answers_without_errors():
    out = subprocess.run([sys.executable, "benchmarks/load_test.py", "--sessions", "4", "--turns", "2",
                          "--budgets", "8", "--json"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["errors"] == 0 and result["solo_errors"] == 0, result["error_samples"]
    assert result["leaks"] == 0  # no answer holds another session's numbers
    assert result["tracebacks"] == 0
    assert result["answered"] == 8 and result["own"] >= 6, result["wrong_samples"]  # (the model errs on x * 10)
    assert result["budget_mb"] == 8.0
    assert result["scheduler"]["peak_rows"] >= 2  # the clients' segments shared forward passes
