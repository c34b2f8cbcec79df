"""Decode and prefill speed of the model step: llama.cpp, float32 and int8 weights, in one run on the same GGUF.

    python3 benchmarks/decode_bench.py [--runs 3] [--tokens 32]

For each path, with 2 threads: ms per generated token after a context of 100 and of 1,500 tokens, and the time
to prefill 1,000 tokens, medians over `--runs`. The in-process formats run the app's own model step
(app.model.ragged.ragged_forward, one row, greedy, in a worker thread as in the app). llama.cpp runs as its own server
(built by scripts/build_llama_server.sh from the llama-cpp-python 0.3.36 sources, the version the issue measured
through llama-cpp-python), one slot, prompt cache off, and its own `timings` give the figures, so HTTP is not
counted. All three read the same token ids: the system prompt and Jargon File entries, cut to length.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import app  # noqa: E402,F401  (first: one intra-op thread in every thread but the model's, app.threads)
import torch  # noqa: E402

from tests.support.llama_server import LlamaServer  # noqa: E402
from app.backends.server_client import ModelServer  # noqa: E402
from app.protocols.textenv.prompt import default_prompt_template, render_prompt  # noqa: E402
from app.model.kvcache import new_kv  # noqa: E402
from app.model.loading import load_model  # noqa: E402
from app.model.ragged import Row, ragged_forward  # noqa: E402
from app.threads import use_model_threads  # noqa: E402
from app.tools.registry import default_tools  # noqa: E402
from app.tools.search import search_tool  # noqa: E402
from server_bench import in_thread  # noqa: E402  (the model runs in a worker thread, as in the app)

CONTEXTS = (100, 1500)
PREFILL = 1000
WORDS = ["kludge", "hacker", "cruft", "daemon", "foobar", "grok", "wizard", "bogus", "frob", "hack", "magic",
         "heisenbug", "tarball", "vaporware", "guru", "bikeshedding", "patch", "elegant", "cookie", "glitch"]


@functools.cache
def _text_ids(tokenizer) -> tuple[int, ...]:
    text = render_prompt(default_prompt_template(), default_tools())
    text += "\n".join(f"Q: What does {w} mean?\n{search_tool(w)}" for w in WORDS * 4)
    return tuple(tokenizer(text, add_special_tokens=False).input_ids)


def context_ids(tokenizer, length: int) -> list[int]:
    ids = _text_ids(tokenizer)
    assert len(ids) >= length, f"only {len(ids)} tokens of text"
    return list(ids[:length])


def in_process(model, ids: list[int], new_tokens: int) -> tuple[float, float]:
    """(seconds to prefill `ids`, median ms per decoded token after them)."""
    use_model_threads()
    kv = new_kv(model.config)
    began = time.perf_counter()
    logits = ragged_forward(model, [Row(kv, ids, 0, 1)])[0]
    prefill = time.perf_counter() - began
    token, steps = int(logits[-1].argmax()), []
    for i in range(new_tokens):
        began = time.perf_counter()
        logits = ragged_forward(model, [Row(kv, [token], len(ids) + i, 1)])[0]
        steps.append(time.perf_counter() - began)
        token = int(logits[-1].argmax())
    return prefill, 1000 * statistics.median(steps)


@torch.inference_mode()
def measure_in_process(model, tokenizer, runs: int, new_tokens: int) -> dict[str, float]:
    """measure() for the app's own model step, warmed up first (run it in a worker thread, as the app does)."""
    in_process(model, context_ids(tokenizer, 50), 2)
    return measure(functools.partial(in_process, model), tokenizer, runs, new_tokens)


def llama_cpp(server: ModelServer, ids: list[int], new_tokens: int) -> tuple[float, float]:
    reply = server.post_json("/completion", {"prompt": ids, "n_predict": new_tokens, "temperature": 0,
                                             "cache_prompt": False, "ignore_eos": True})
    timings = reply["timings"]
    assert timings["prompt_n"] == len(ids), timings
    return timings["prompt_ms"] / 1000, timings["predicted_per_token_ms"]


def measure(step, tokenizer, runs: int, new_tokens: int) -> dict[str, float]:
    """Medians over runs: decode ms/token at each context, prefill seconds of PREFILL tokens."""
    cells: dict[str, list[float]] = {}
    for _ in range(runs):
        for context in CONTEXTS:
            cells.setdefault(f"decode@{context}", []).append(step(context_ids(tokenizer, context), new_tokens)[1])
        cells.setdefault("prefill", []).append(step(context_ids(tokenizer, PREFILL), 1)[0])
    return {key: statistics.median(values) for key, values in cells.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32, help="tokens decoded per measurement")
    args = parser.parse_args()
    os.environ["MODEL_THREADS"] = "2"

    results: dict[str, dict[str, float]] = {}
    tokenizer = None
    for weights in ("float32", "int8"):  # float32 first: the reference
        loaded = load_model(weights=weights)
        tokenizer = loaded.tokenizer
        results[weights] = in_thread(measure_in_process, loaded.model, tokenizer, args.runs, args.tokens)
        del loaded
    with LlamaServer(ctx=4096, parallel=1, threads=2) as server:
        client = ModelServer(server.url, timeout_s=300)
        llama_cpp(client, context_ids(tokenizer, 50), 2)  # warm-up
        results["llama.cpp"] = measure(lambda ids, n: llama_cpp(client, ids, n), tokenizer, args.runs, args.tokens)

    base, cpp = results["float32"], results["llama.cpp"]
    print(f"\n{args.runs} runs each, medians; {args.tokens} tokens decoded per run, 2 threads\n")
    print("| path | decode @100, ms/token | decode @1500, ms/token | prefill 1,000 tokens, s "
          "| decode vs float32 | decode vs llama.cpp | prefill vs llama.cpp |")
    print("|---|---|---|---|---|---|---|")
    for name, cell in results.items():
        decode = [f"{cell[f'decode@{c}']:.1f}" for c in CONTEXTS]
        vs_base = "/".join(f"{cell[f'decode@{c}'] / base[f'decode@{c}']:.2f}" for c in CONTEXTS)
        vs_cpp = "/".join(f"{cell[f'decode@{c}'] / cpp[f'decode@{c}']:.1f}" for c in CONTEXTS)
        print(f"| {name} | {' | '.join(decode)} | {cell['prefill']:.2f} | {vs_base}× | {vs_cpp}× "
              f"| {cell['prefill'] / cpp['prefill']:.2f}× |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
