"""Cache on vs off, or guide on vs off, side by side: an app.engine.comparisons.Comparison or GuideComparison -> a markdown
table. Pure, no server needed."""

from __future__ import annotations

from app.engine import Comparison, GuideComparison, forced_tokens, steered_tokens
from app.episode import Episode
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


def _tool_calls(episode: Episode) -> str:
    calls = [f"{s.tool}: {s.query}" if s.tool else "malformed" for s in episode.segments if s.kind == "tool"]
    return _cell("\n".join(calls)) if calls else "none"


def guide_markdown(result: GuideComparison) -> str:
    """The guide on and off side by side: each answer, what the guide forced and steered, the model's own
    tokens, the tool calls and the time."""
    on, off = result.guided, result.unguided
    rows = [
        ("answer", _cell(_answer(on)), _cell(_answer(off))),
        ("last stop", escape_text(stop_text(on.stop)), escape_text(stop_text(off.stop))),
        ("tool calls", _tool_calls(on), _tool_calls(off)),
        ("tokens forced by the guide", str(forced_tokens(on)), str(forced_tokens(off))),
        ("tokens steered by the guide", count_text(steered_tokens(on)), count_text(steered_tokens(off))),
        ("tokens the model chose", str(sum(s.generated_tokens for s in on.model_segments)),
         str(sum(s.generated_tokens for s in off.model_segments))),
        ("wall time", f"{result.guided_s:.2f} s", f"{result.unguided_s:.2f} s"),
        ("segments", str(len(on.segments)), str(len(off.segments))),
    ]
    table = ["| | guide on | guide off |", "|---|---|---|"]
    table += [f"| {name} | {a} | {b} |" for name, a, b in rows]
    if result.stopped:  # a cut-short run's answer is not the one it would have written
        summary = "**stopped by user**: no verdict on the answers"
    else:
        steered = steered_tokens(on)
        steered = "an unknown number (the model server does not say)" if steered is None else str(steered)
        summary = (f"**same answer: {'yes' if result.same_answer else 'no'}** · with the guide, {forced_tokens(on)} "
                   f"tokens were forced and {steered} steered; the guide-off column is what the model writes alone")
    return f"Question: {escape_text(on.question)}\n\n" + "\n".join(table) + f"\n\n{summary}"
