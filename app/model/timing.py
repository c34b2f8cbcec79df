"""The one timing the loaders make: which kernel is faster on this CPU, decided once per process."""

from __future__ import annotations

import time
from collections.abc import Callable


def best_of(run: Callable[[], object], times: int = 3) -> float:
    """The shortest of `times` timed calls of `run`, in seconds, after one untimed call (first-call costs)."""
    run()
    taken = []
    for _ in range(times):
        start = time.perf_counter()
        run()
        taken.append(time.perf_counter() - start)
    return min(taken)
