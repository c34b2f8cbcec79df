"""Which threads run PyTorch's parallel kernels: only the model's scheduler thread (app.backends.scheduler). Every thread
that runs a parallel kernel gets its own OpenMP pool, and more pool threads than cores slows small kernels everywhere,
so every thread starts with one intra-op thread (OMP_NUM_THREADS=1) and the scheduler's alone takes MODEL_THREADS
(docs/performance.md)."""

from __future__ import annotations

import os
import threading


def one_thread_by_default() -> None:
    """Make one intra-op thread every thread's default (effective only before torch is imported)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def model_threads() -> int:
    """Intra-op threads for the model's forward passes: MODEL_THREADS, else the cores this process may use."""
    value = os.environ.get("MODEL_THREADS", "").strip()
    if value:
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"MODEL_THREADS must be a whole number of at least 1, not {value!r}")
        return int(value)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def default_threads() -> int:
    """Intra-op threads of every thread but the scheduler's (OMP_NUM_THREADS, which one_thread_by_default sets)."""
    value = os.environ.get("OMP_NUM_THREADS", "1").strip()
    return int(value) if value.isdigit() and int(value) > 0 else 1


def use_model_threads() -> None:
    """Give the calling thread (the one that runs the model's passes) MODEL_THREADS intra-op threads, leaving every
    other thread's default as it was."""
    import torch

    torch.set_num_threads(model_threads())
    torch.get_num_threads()  # PyTorch settles a thread's count lazily, from the default: settle this one's now
    # torch.set_num_threads sets that default too; another thread sets it back (its own count is the default)
    restore = threading.Thread(target=torch.set_num_threads, args=(default_threads(),), name="threads-default")
    restore.start()
    restore.join()
