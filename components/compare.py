"""Cache on vs off, side by side: an app.compare.Comparison -> a markdown table. Pure, no server needed."""

from __future__ import annotations

from app.compare import Comparison
from app.engine import Episode
from app.episode import count_text
from components.chat import escape_text, stop_text


def _cell(text: str) -> str:
    """Text inside a markdown table cell: escaped, one line (newlines as <br>)."""
    text = text.strip()
    if not text:
        return "*(no text)*"
    return "<br>".join(escape_text(line) for line in text.splitlines())


def _answer(episode: Episode) -> str:
    """What the model wrote in this turn (every model segment, tool output left out)."""
    return "".join(s.text for s in episode.model_segments)


def speedup_text(speedup: float) -> str:
    return "∞" if speedup == float("inf") else f"{speedup:.2f}×"


def compare_markdown(result: Comparison) -> str:
    on, off = result.cached, result.uncached
    rows = [
        ("answer", _cell(_answer(on)), _cell(_answer(off))),
        ("last stop", escape_text(stop_text(on.stop)), escape_text(stop_text(off.stop))),
        ("wall time", f"{result.cached_s:.2f} s", f"{result.uncached_s:.2f} s"),
        ("tokens prefilled, all segments", count_text(on.prefill_tokens), count_text(off.prefill_tokens)),
        ("tokens reused, all segments", count_text(on.reused_tokens), count_text(off.reused_tokens)),
        ("segments", str(len(on.segments)), str(len(off.segments))),
    ]
    table = ["| | cache on | cache off |", "|---|---|---|"]
    table += [f"| {name} | {a} | {b} |" for name, a, b in rows]
    identical = "yes" if result.identical else "no"
    if result.stopped:  # a cut-short run's tokens and time say nothing about the cache
        summary = "**stopped by user**: no verdict on identical tokens or speed-up"
    else:
        summary = (f"**identical tokens: {identical}** · speed-up with the cache: "
                   f"**{speedup_text(result.speedup)}** ({result.uncached_s:.2f} s → {result.cached_s:.2f} s)")
    question = escape_text(on.question)
    return f"Question: {question}\n\n" + "\n".join(table) + f"\n\n{summary}"
