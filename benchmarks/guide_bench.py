"""What the guide (app.decoding.guide) costs per decode step, beside the step itself, in one run.

    python3 benchmarks/guide_bench.py [--runs 5] [--weights int8]

The guide's work per generated token, as app.backends.row.Row does it greedy: the grammar's mask and
the greedy choice under it (with the check whether the model's first choice was banned), the token consumed, and the
forced text looked up for the next pass; timed over the tokens of real guided segments (a call, a look-up's
answer, an arithmetic answer, a chit-chat answer). The decode step is the app's own model step
(app.model.ragged.ragged_forward, one row, 2 threads) after ~800 tokens of context. Prints medians and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import app  # noqa: E402,F401  (first: one intra-op thread in every thread but the model's, app.threads)
import torch  # noqa: E402

from app.protocols.textenv.grammar import build_guide  # noqa: E402
from app.model.kvcache import new_kv  # noqa: E402
from app.backends.local import LocalBackend  # noqa: E402
from app.model.loading import load_model  # noqa: E402
from app.model.ragged import Row, ragged_forward  # noqa: E402
from app.protocols.base import encode  # noqa: E402
from app.threads import use_model_threads  # noqa: E402
from decode_bench import context_ids  # noqa: E402
from server_bench import in_thread  # noqa: E402

TOOLS = {"Calculator": 200, "Search": 32}
ENTRY = "grok: To understand. Connotes intimate and exhaustive knowledge"
SEGMENTS = [  # (guide, the text the segment writes)
    (build_guide(TOOLS), "<request><Search>grok<call>"),
    (build_guide(TOOLS, owed=ENTRY, after_tool=True), f"\nResult = {ENTRY}<submit>"),
    (build_guide(TOOLS, owed="943", after_tool=True), "\nResult = 943<submit>"),
    (build_guide(TOOLS), "Result = Hello! I am a small assistant with a calculator and the Jargon File<submit>"),
]


def guide_us_per_token(loaded, runs: int) -> float:
    """Median microseconds of the guide's work per token over SEGMENTS (matcher built per segment, as the app)."""
    vocab, tokenizer = loaded.guide_vocab, loaded.tokenizer
    logits = torch.randn(loaded.model.config.vocab_size)
    per_token = []
    for _ in range(runs):
        tokens, began = 0, time.perf_counter()
        for guide, text in SEGMENTS:
            matcher = vocab.matcher(guide.grammar)
            for token in encode(tokenizer, text):
                matcher.greedy(logits)  # (greedy, the page's setting: app.decoding.choose)
                matcher.consume([token])
                if matcher.done:
                    break
                matcher.forced()
                tokens += 1
        per_token.append((time.perf_counter() - began) / tokens * 1e6)
    return statistics.median(per_token)


def step_ms(loaded, runs: int, context: int = 800, steps: int = 16) -> float:
    """Median ms of one decode step of one row after `context` tokens (the app's ragged pass)."""
    model, ids = loaded.model, context_ids(loaded.tokenizer, context)

    def measure() -> float:
        use_model_threads()
        kv = new_kv(model.config)
        with torch.inference_mode():
            logits = ragged_forward(model, [Row(kv, ids, 0, 1)])[0]
            times, position = [], len(ids)
            for _ in range(steps):
                token = int(logits[-1].argmax())
                began = time.perf_counter()
                logits = ragged_forward(model, [Row(kv, [token], position, 1)])[0]
                times.append(time.perf_counter() - began)
                position += 1
        return statistics.median(times) * 1000

    return statistics.median(in_thread(measure) for _ in range(runs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--weights", default=None, help="int8 or float32 (default: the app's)")
    args = parser.parse_args()
    loaded = LocalBackend(load_model(weights=args.weights))
    loaded.guide_vocab  # (built once per model, at the first guided segment)
    guide = guide_us_per_token(loaded, args.runs)
    step = step_ms(loaded, args.runs)
    print(f"weights {loaded.weights}; medians of {args.runs} runs")
    print(f"guide per token: {guide:.1f} us (mask, consume, forced text; matcher built per segment)")
    print(f"decode step:     {step:.2f} ms (one row, ~800 tokens of context)")
    print(f"guide / step:    {guide / 1000 / step * 100:.2f} %")


if __name__ == "__main__":
    main()
