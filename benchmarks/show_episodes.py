"""Whole episodes as the model wrote them, segment by segment with each stop reason and who wrote the tokens: the
before/after of docs/training.md (`ADAPTER=off` runs the base model).

    python3 benchmarks/show_episodes.py "What is 8215 - 8454?" "What does grok mean?" --protocol chat --guide off
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.backends.local import LocalBackend  # noqa: E402
from app.engine.engine import Engine  # noqa: E402
from app.model.loading import load_model  # noqa: E402
from benchmarks.answer_quality import PAGE  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("questions", nargs="+")
    parser.add_argument("--protocol", choices=("auto", "textenv", "chat"), default="auto")
    parser.add_argument("--guide", choices=("on", "off"), default="off")
    args = parser.parse_args()
    backend = LocalBackend(load_model())
    engine = Engine(backend, protocol=args.protocol)
    settings = dataclasses.replace(PAGE, guide=args.guide == "on")
    print(f"{backend.name}, protocol {engine.protocol.name}, guide {args.guide}")
    for question in args.questions:
        episode = engine.ask(engine.new_session(), question, settings)
        print(f"\nQ: {question}")
        for segment in episode.segments:
            if segment.kind == "tool":
                print(f"  [tool {segment.tool}] {segment.result!r}")
            else:
                who = Counter(p.value for p in segment.token_provenance())
                print(f"  [model, {segment.stop.label if segment.stop else '?'}; {dict(who)}] {segment.text!r}")
    backend.scheduler.release()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
