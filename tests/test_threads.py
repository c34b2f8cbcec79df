"""Only the scheduler's thread runs parallel kernels (app.threads): every other thread starts with one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from app.threads import model_threads

ROOT = Path(__file__).resolve().parent.parent


# A fresh process (OpenMP reads its settings once): a tiny model, a scheduler, and `seen`, the intra-op threads each
# of the scheduler's passes ran with.
PROBE = ("import os; os.environ['MODEL_THREADS'] = '2'; os.environ.pop('OMP_NUM_THREADS', None);"
         "import threading, app, torch, transformers as t; import app.model.ragged as ragged;"
         "from app.backends.scheduler import Scheduler; from app.model.kvcache import TokenCache;"
         "m = t.LlamaForCausalLM(t.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,"
         " num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)).eval();"
         "seen = []; run = ragged.ragged_forward;"
         "ragged.ragged_forward = lambda model, rows: (seen.append(torch.get_num_threads()), run(model, rows))[1];"
         "s = Scheduler(m);")


def probe(code: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", PROBE + code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split()


def test_importing_the_backend_makes_one_intra_op_thread_the_default_and_the_scheduler_takes_more():
    printed = probe("s.forward(TokenCache([1, 2, 3])); print(torch.get_num_threads(), seen[0])")
    assert printed == ["1", "2"]  # this (main) thread: one; the scheduler's: MODEL_THREADS


def test_threads_started_after_the_scheduler_took_its_threads_still_get_one():
    """Regression: torch.set_num_threads on the scheduler's thread also set the default of threads started later,
    so every batch row got an OpenMP pool of two on its first argmax; libgomp, then managing more threads than
    cores, put its workers to sleep between kernels and an 8-row step ran ~1.7x slower."""
    printed = probe("s.forward(TokenCache([1, 2, 3]));"
                    "row = []; th = threading.Thread(target=lambda: row.append(torch.get_num_threads()));"
                    "th.start(); th.join(); s.forward(TokenCache([4, 5, 6])); print(row[0], seen[-1])")
    assert printed == ["1", "2"]  # a later thread: the default; the scheduler's: still MODEL_THREADS


@pytest.mark.parametrize("value, expected", [("3", 3), ("1", 1), (" 2 ", 2)])
def test_model_threads_reads_its_setting(monkeypatch, value, expected):
    monkeypatch.setenv("MODEL_THREADS", value)
    assert model_threads() == expected


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5"])
def test_a_bad_model_threads_is_a_clear_error(monkeypatch, value):
    monkeypatch.setenv("MODEL_THREADS", value)
    with pytest.raises(ValueError, match="MODEL_THREADS must be a whole number"):
        model_threads()


def test_without_a_setting_the_model_gets_every_core(monkeypatch):
    """Every core this process may use (its affinity, which a container or taskset narrows), else every core."""
    monkeypatch.delenv("MODEL_THREADS", raising=False)
    assert model_threads() == len(os.sched_getaffinity(0))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 2, 5}, raising=False)  # 3 of the machine's cores
    assert model_threads() == 3
    monkeypatch.delattr(os, "sched_getaffinity")  # (no affinity call on this system)
    monkeypatch.setattr(os, "cpu_count", lambda: 6)
    assert model_threads() == 6


def tiny_llama():
    import transformers as t

    config = t.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1)
    return t.LlamaForCausalLM(config).eval()


def test_the_scheduler_thread_ends_when_released_and_a_later_pass_starts_another():
    """Regression: a process that ran two models (a benchmark of two formats) kept two scheduler threads, so two
    OpenMP pools, and the second model's small kernels ran ~2x slower."""
    from app.model.kvcache import TokenCache
    from app.backends.scheduler import Scheduler

    scheduler = Scheduler(tiny_llama())
    logits, _, _ = scheduler.forward(TokenCache([1, 2, 3]))
    first = scheduler.thread
    assert first is not None and first.is_alive()
    scheduler.release()
    assert not first.is_alive() and scheduler.thread is None
    again, _, _ = scheduler.forward(TokenCache([1, 2, 3]))
    assert scheduler.thread is not None and scheduler.thread is not first
    assert torch.equal(logits, again)
    scheduler.release()
