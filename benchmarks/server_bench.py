"""In-process engine vs a local llama.cpp server, measured in one run on the same machine and the same GGUF.

    python3 benchmarks/server_bench.py [--runs 3] [--chats 4]
    python3 benchmarks/server_bench.py --url http://127.0.0.1:8000   # only a server already running (e.g. vLLM)

1. Decode speed: one long model segment (greedy, 64 new tokens, no tool call) per run on each backend, in a
   worker thread as in the app; ms/token = time from the segment's first text to its end / (generated tokens - 1),
   median over the runs.
2. Concurrent chats: `--chats` sessions started at once (one thread each), each asking two calculator questions;
   wall time for all, mean turn latency, and how many answers used the tool as expected. Two rounds of new
   sessions: llama.cpp keeps a cached prefix per slot, so in the first round each slot the system prompt has not
   reached yet prefills it once; in the second every slot holds it (in process, every session forks one
   prefilled copy, so both rounds start alike).
The two backends never run at the same time (the server is idle while the in-process model runs). Drafts are off
(draft_tokens=0) on both, so the figures compare the models' decoding, not prompt lookup. The server is started
here (scripts/build_llama_server.sh must have built it): 2 threads, `-np` = chats, 4,096 tokens per slot.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.backends.base import Backend  # noqa: E402
from tests.support.llama_server import LlamaServer  # noqa: E402
from app.backends.local import LocalBackend  # noqa: E402
from app.backends.server import ServerBackend  # noqa: E402
from app.backends.server_client import ModelServer  # noqa: E402
from app.engine.engine import Engine  # noqa: E402
from app.episode import SegmentFinished, TextDelta
from app.model.loading import load_model  # noqa: E402
from app.protocols.textenv.markers import CALL  # noqa: E402
from app.settings import Settings

LONG = "Write a long story about a robot who learns to paint."
DECODE = Settings(max_new_tokens=64, max_length=4096, max_turns=0, draft_tokens=0)
CHAT = Settings(max_new_tokens=48, max_length=4096, draft_tokens=0)
CHAT_QUESTIONS = [("What is 41 * 23?", "What is 12 * 9?"), ("What is 7 + 5?", "What is 100 - 37?"),
                  ("What is 58 * 17?", "What is 96 / 8?"), ("What is 1234 + 4321?", "What is 77 - 39?"),
                  ("What is 15 * 15?", "What is 81 / 9?"), ("What is 33 + 44?", "What is 9 * 9?"),
                  ("What is 250 - 125?", "What is 64 / 4?"), ("What is 13 * 13?", "What is 500 + 250?")]


def in_thread(fn, *args):
    """fn(*args) in a worker thread, as the app runs turns (Gradio's workers). On this machine, under load, the
    in-process model decoded ~3× slower in the main thread than in a worker (229 vs 72 ms/token, one sitting)."""
    result: list = []
    thread = threading.Thread(target=lambda: result.append(fn(*args)))
    thread.start()
    thread.join(timeout=900)
    if not result:
        raise RuntimeError(f"{fn.__name__} failed or did not finish in its thread (see the traceback above)")
    return result[0]


def decode_ms_per_token(engine: Engine) -> tuple[float, int]:
    """One long segment in a fresh session: (ms per generated token after the first, tokens generated)."""
    first = None
    for event in engine.turn(engine.new_session(), LONG, DECODE):
        if isinstance(event, TextDelta) and first is None:
            first = time.perf_counter()
        elif isinstance(event, SegmentFinished):
            end, generated = time.perf_counter(), event.segment.generated_tokens
    if first is None or generated < 2:
        raise RuntimeError(f"the segment generated {generated} token(s): nothing to time")
    return (end - first) * 1000 / (generated - 1), generated


def concurrent_chats(engine: Engine, chats: int) -> dict:
    """`chats` sessions at once, two questions each: wall time, mean turn latency, tool calls as expected."""
    latencies: list[float] = []
    called: list[bool] = []
    prefilled: list[int | None] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def chat(questions: tuple[str, str]) -> None:
        try:
            session = engine.new_session()
            for question in questions:
                began = time.perf_counter()
                episode = engine.ask(session, question, CHAT)
                with lock:
                    latencies.append(time.perf_counter() - began)
                    prefilled.append(episode.prefill_tokens)
                    called.append(episode.segments[0].stop.string == CALL and episode.segments[1].tool == "Calculator")
        except BaseException as error:  # reported after the join: a failed chat must not vanish in its thread
            with lock:
                errors.append(error)

    threads = [threading.Thread(target=chat, args=(CHAT_QUESTIONS[i % len(CHAT_QUESTIONS)],)) for i in range(chats)]
    began = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=900)
    wall = time.perf_counter() - began
    if errors or any(t.is_alive() for t in threads):
        raise RuntimeError(f"concurrent chats failed: {errors or 'a chat did not finish in 900 s'}")
    return {"wall_s": wall, "turns": len(latencies), "mean_turn_s": statistics.mean(latencies),
            "max_turn_s": max(latencies), "tool_calls_ok": sum(called), "turn_s": [round(t, 1) for t in latencies],
            "prefilled": prefilled, "load": round(os.getloadavg()[0], 1)}


def measure(name: str, backend: Backend, runs: int, chats: int) -> dict:
    engine = Engine(backend)
    engine.new_session()  # the shared prompt: prefilled in process, or sent once to warm the server's cache
    decode_engine_warm = in_thread(decode_ms_per_token, engine)  # warm-up (first request, allocations): not counted
    samples = [in_thread(decode_ms_per_token, engine) for _ in range(runs)]
    print(f"{name}: warm-up {decode_engine_warm[0]:.1f} ms/token; runs "
          + ", ".join(f"{ms:.1f} ms ({n} tokens)" for ms, n in samples), flush=True)
    result = {"decode_ms": statistics.median(ms for ms, _ in samples),
              "decode_runs": [round(ms, 1) for ms, _ in samples]}
    for round_ in (1, 2):
        chats_result = concurrent_chats(engine, chats)
        print(f"{name}: {chats} chats at once, round {round_}: {chats_result}", flush=True)
        result.update({f"{key}_{round_}": value for key, value in chats_result.items()})
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="decode measurements per backend (median)")
    parser.add_argument("--chats", type=int, default=4, help="sessions at once")
    parser.add_argument("--url", help="measure only this running server (MODEL_ID: its tokenizer), not the others")
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()}", flush=True)
    if args.url:
        backend = ServerBackend.connect(ModelServer(args.url))
        table(args.chats, {backend.name: measure(backend.name, backend, args.runs, args.chats)})
        return
    loaded = load_model()
    local = measure("in-process", LocalBackend(loaded), args.runs, args.chats)
    with LlamaServer(ctx=4096 * args.chats, parallel=args.chats, threads=2) as llama:
        server = measure("llama-server", ServerBackend.connect(ModelServer(llama.url)), args.runs, args.chats)
    table(args.chats, {f"in-process ({loaded.weights})": local, "llama-server (Q4_1)": server})
    print(f"\ndecode runs (ms/token): in-process {local['decode_runs']}, llama-server {server['decode_runs']}; "
          f"per token {local['decode_ms'] / server['decode_ms']:.1f}× faster on the server; concurrent chats, wall "
          f"in-process / server: round 1 {local['wall_s_1'] / server['wall_s_1']:.2f}×, "
          f"round 2 {local['wall_s_2'] / server['wall_s_2']:.2f}×")
    print(f"load average after: {os.getloadavg()}")


def table(chats: int, columns: dict[str, dict]) -> None:
    """The measured figures as a Markdown table, one column per backend."""
    print(f"\n| {chats} chats × 2 turns | " + " | ".join(columns) + " |")
    print("|---|" + "---|" * len(columns))
    rows = [("decode ms/token (median of runs)", "decode_ms", "{:.1f}")]
    for r in (1, 2):
        rows += [(f"round {r}: all chats, wall", f"wall_s_{r}", "{:.1f} s"),
                 (f"round {r}: turn latency, mean / max", (f"mean_turn_s_{r}", f"max_turn_s_{r}"), "{:.2f} / {:.2f} s"),
                 (f"round {r}: turns with the expected tool call", f"tool_calls_ok_{r}", "{}/" + str(2 * chats))]
    for label, key, fmt in rows:
        keys = key if isinstance(key, tuple) else (key,)
        print(f"| {label} | " + " | ".join(fmt.format(*(c[k] for k in keys)) for c in columns.values()) + " |")

if __name__ == "__main__":
    main()
