"""What the chat protocol costs beside textenv: the same questions, one episode each in a fresh session, greedy.

    python3 benchmarks/protocol_bench.py                 # guide off and on, 3 rounds (~2 min on 2 cores)

Per protocol and guide setting: the system prompt's tokens (prefilled once per process, shared), and per episode
the tokens prefilled (the question, tool results and what the guide forced), reused from the cache, generated, tool
calls, and the time (median over rounds; the protocols' runs alternate within each round, so a noisy machine moves
both alike). Ratios chat / textenv are from this one run.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.backends.local import LocalBackend  # noqa: E402
from app.engine.engine import Engine  # noqa: E402
from app.model.loading import load_model  # noqa: E402
from components.inputs import DEFAULTS as PAGE  # noqa: E402

QUESTIONS = ["What is 41 * 23?", "What is 1,250 + 3,780?", "What is the square root of 1764?", "What is 7 - 10?",
             "What does kludge mean?", "What is a heisenbug?", "Define tarball.", "Hello, who are you?",
             "Thanks!", "What is 60% of 760?"]


def episode_figures(engine: Engine, settings) -> list[dict]:
    rows = []
    for question in QUESTIONS:
        episode = engine.ask(engine.new_session(), question, settings)
        rows.append(dict(ms=episode.ms, prefill=episode.prefill_tokens, reused=episode.reused_tokens,
                         generated=sum(s.generated_tokens for s in episode.model_segments),
                         calls=sum(s.kind == "tool" for s in episode.segments), answer=episode.answer))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--guide", nargs="+", choices=("on", "off"), default=["off", "on"])
    args = parser.parse_args()
    backend = LocalBackend(load_model())
    engines = {name: Engine(backend, protocol=name) for name in ("textenv", "chat")}
    print(f"model: {backend.name}")
    for guide in args.guide:
        settings = dataclasses.replace(PAGE, guide=guide == "on")
        for engine in engines.values():  # warm up: the shared prompt, the guide's tables
            engine.ask(engine.new_session(), "What is 1 + 1?", settings)
        runs = {name: [] for name in engines}
        for _ in range(args.rounds):
            for name, engine in engines.items():
                runs[name].append(episode_figures(engine, settings))
        print(f"\nguide {guide}, {len(QUESTIONS)} questions, {args.rounds} rounds (medians of the per-round totals)")
        print("| protocol | system prompt tokens | prefilled / episode | reused / episode | generated / episode | "
              "tool calls | ms / episode |\n|---|---|---|---|---|---|---|")
        totals = {}
        for name, rounds in runs.items():
            n = len(QUESTIONS)
            total = {key: median(sum(row[key] for row in rows) for rows in rounds) / n
                     for key in ("prefill", "reused", "generated", "calls", "ms")}
            totals[name] = total
            prompt = len(engines[name].new_session().cache)
            print(f"| {name} | {prompt} | {total['prefill']:.1f} | {total['reused']:.0f} | {total['generated']:.1f} | "
                  f"{total['calls']:.1f} | {total['ms']:.0f} |")
        ratio = totals["chat"]["ms"] / totals["textenv"]["ms"]
        print(f"chat / textenv time an episode: {ratio:.2f}x; prefilled tokens: "
              f"{totals['chat']['prefill'] / totals['textenv']['prefill']:.2f}x")
        answers = {name: [row["answer"] for row in rounds[0]] for name, rounds in runs.items()}
        for question, a, b in zip(QUESTIONS, answers["textenv"], answers["chat"]):
            print(f"- {question}  textenv: {a[:60]!r}  chat: {b[:60]!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
