"""Many chats at once on the in-process model: what the batched scheduler gives, ratios from one run.

    python3 benchmarks/concurrency_bench.py                 # 1, 2, 4, 8 chats; then the batch of 8 (~1 min)
    python3 benchmarks/concurrency_bench.py --chart FILE.png  # ... and a chart of tokens/s and p95 TTFT

Each chat is a fresh session on the default prompt, greedy, the page's settings; it asks a calculator question
and then a look-up, each with numbers / words of its own. All chats of a round send their first question at the
same moment. Measured per question: time to first text (TTFT) and turn time; per round: generated tokens per
second over the whole round. Then `Engine.run` with 8 questions against the same 8 one after another.

Every measurement is taken `--repeat` times (default 3), the rounds of each size in turn (1, 2, 4, 8, 1, 2, ...),
and the table shows medians: one round of one chat lasts ~0.4 s, and on a noisy machine a single one moved every
ratio by 10-20 % (one chat alone 137-164 tokens/s in four runs of one sitting).
"""

from __future__ import annotations

import argparse
import gc
from dataclasses import replace
import sys
import threading
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.engine.engine import Engine  # noqa: E402
from app.episode import TextDelta
from app.backends.local import LocalBackend  # noqa: E402
from app.model.loading import load_model  # noqa: E402
from app.settings import Settings
from components.inputs import DEFAULTS as PAGE  # noqa: E402  (the page's settings; no Gradio import)
WORDS = ["kludge", "cruft", "foobar", "wizard", "daemon", "frob", "hack", "bogus"]


def questions(chat: int) -> list[str]:
    return [f"What is {17 + chat} * {23 + 2 * chat}?", f"What does {WORDS[chat % len(WORDS)]} mean?"]


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def run_chat(engine: Engine, chat: int, start: threading.Barrier | None, out: list, settings: Settings) -> None:
    session = engine.new_session()
    if start is not None:
        start.wait()
    for turn, question in enumerate(questions(chat)):
        sent, first = time.perf_counter(), None
        for event in engine.turn(session, question, settings):
            if first is None and isinstance(event, TextDelta):
                first = time.perf_counter()
        episode = session.episodes[-1]
        out.append(dict(chat=chat, turn_no=turn, ttft=(first or time.perf_counter()) - sent, turn=time.perf_counter() - sent,
                        tokens=sum(s.end - s.start for s in episode.model_segments), answer=episode.answer))
        # (tokens: every token the model segments wrote, the guide's forced ones too: the scheduler's work)


def round_of(engine: Engine, chats: int, settings: Settings) -> dict:
    start, out = threading.Barrier(chats + 1), []
    threads = [threading.Thread(target=run_chat, args=(engine, c, start, out, settings)) for c in range(chats)]
    for t in threads:
        t.start()
    start.wait()
    began = time.perf_counter()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - began
    first_turns = [r["ttft"] for r in out if r["turn_no"] == 0]  # the questions sent at the same moment
    return dict(chats=chats, seconds=seconds, tokens=sum(r["tokens"] for r in out), ttft_p95=p95(first_turns),
                turn_p95=p95([r["turn"] for r in out]), rows=out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chats", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--repeat", type=int, default=3, help="runs of every measurement (the table: medians)")
    parser.add_argument("--chart", type=Path, help="write a chart of tokens/s and p95 TTFT to this file")
    parser.add_argument("--no-guide", action="store_true", help="guided answers off (the page's default: on)")
    parser.add_argument("--protocol", choices=("textenv", "chat"), default="textenv",
                        help="how model and tools talk (app/protocols/; default: textenv)")
    args = parser.parse_args()
    settings = replace(PAGE, guide=not args.no_guide)
    if args.repeat < 1 or 1 not in args.chats:
        parser.error("--repeat must be at least 1, and --chats must hold 1 (the baseline)")
    engine = Engine(LocalBackend(load_model()), protocol=args.protocol)
    print(f"protocol {engine.protocol.name}, guide {'off' if args.no_guide else 'on'}")
    engine.ask(engine.new_session(), "What is 1 + 1?", settings)  # warm up: the shared prompt cache, first passes
    gc.freeze()  # as app.py does once warm: what lives as long as the process stays out of the collector's scans
    alone: list = []  # every chat by itself, for its own turn times
    for _ in range(args.repeat):
        for chat in range(max(args.chats)):
            run_chat(engine, chat, None, alone, settings)
    solo_turn = {key: median(r["turn"] for r in alone if (r["chat"], r["turn_no"]) == key)
                 for key in {(r["chat"], r["turn_no"]) for r in alone}}
    runs = {n: [] for n in args.chats}
    for _ in range(args.repeat):
        for n in args.chats:
            r = round_of(engine, n, settings)
            runs[n].append(dict(tps=r["tokens"] / r["seconds"], tokens=r["tokens"], ttft_p95=r["ttft_p95"],
                                turn_p95=r["turn_p95"],
                                worst=max(row["turn"] / solo_turn[row["chat"], row["turn_no"]] for row in r["rows"])))
    rounds = [dict(chats=n, **{k: median(run[k] for run in runs[n]) for k in runs[n][0]}) for n in args.chats]
    solo = rounds[args.chats.index(1)]
    print(f"medians of {args.repeat} runs; guide {'off' if args.no_guide else 'on'}")
    print(f"| chats at once | tokens generated | tokens/s | × 1 chat | p95 TTFT, s | × 1 chat | p95 turn, s | "
          f"worst turn / its solo turn |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rounds:
        print(f"| {r['chats']} | {r['tokens']:.0f} | {r['tps']:.1f} | {r['tps'] / solo['tps']:.2f} | "
              f"{r['ttft_p95']:.2f} | {r['ttft_p95'] / solo['ttft_p95']:.2f} | {r['turn_p95']:.2f} | {r['worst']:.2f} |")

    batch_questions = [questions(c)[c % 2] for c in range(8)]
    sequential, together, same = [], [], True
    for _ in range(args.repeat):
        began = time.perf_counter()
        one_by_one = [engine.ask(engine.new_session(), q, settings) for q in batch_questions]
        sequential.append(time.perf_counter() - began)
        began = time.perf_counter()
        batched = engine.run(batch_questions, settings)
        together.append(time.perf_counter() - began)
        same = same and all(a.token_ids == b.token_ids for a, b in zip(one_by_one, batched))
    print(f"\nEngine.run, 8 questions: one after another {median(sequential):.2f} s, as one batch "
          f"{median(together):.2f} s ({median(sequential) / median(together):.2f}× faster); same tokens: {same}")
    stats = engine.backend.scheduler.stats
    print(f"scheduler: {stats.steps} steps, mean {stats.rows / max(1, stats.steps):.2f} rows a step, "
          f"peak {stats.peak_rows}")
    if args.chart:
        chart(rounds, args.chart)
    return 0


def chart(rounds: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chats = [r["chats"] for r in rounds]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
    left.plot(chats, [r["tps"] for r in rounds], marker="o")
    left.set(xlabel="chats at once", ylabel="generated tokens/s", title="Throughput", xticks=chats)
    right.plot(chats, [r["ttft_p95"] for r in rounds], marker="o", color="tab:orange")
    right.set(xlabel="chats at once", ylabel="seconds", title="p95 time to first text", xticks=chats)
    right.set_ylim(bottom=0)
    left.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"chart: {path}")


if __name__ == "__main__":
    raise SystemExit(main())
