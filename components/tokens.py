"""Token view: the whole session's ids colour-coded by who wrote them, for gr.HighlightedText.

One entry per span (system prompt, user message, model segment, tool output); each span's text is its own
ids decoded, never the history re-tokenized. Cost is one decode per span, so long sessions stay cheap.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from app.engine import Span

ROLES = ("system", "user", "model", "tool")
COLOR_MAP = {"system": "#9ca3af", "user": "#60a5fa", "model": "#34d399", "tool": "#fbbf24"}


def token_spans(ids: Sequence[int], spans: Sequence[Span], decode: Callable[[list[int]], str]) -> list[tuple[str, str]]:
    """[(text, role)] for HighlightedText; tokens not covered by a span (none in a consistent session) are
    shown as `model` only if they follow the last span, so nothing the model holds is hidden."""
    out: list[tuple[str, str]] = []
    end = 0
    for span in spans:
        out.append((decode(list(ids[span.start:span.end])), span.role))
        end = max(end, span.end)
    if end < len(ids):
        out.append((decode(list(ids[end:])), "model"))
    return out


def token_counts(spans: Sequence[Span]) -> dict[str, int]:
    counts = dict.fromkeys(ROLES, 0)
    for span in spans:
        counts[span.role] += span.end - span.start
    return counts


def token_summary(spans: Sequence[Span]) -> str:
    counts = token_counts(spans)
    return " · ".join(f"{role} {counts[role]}" for role in ROLES) + f" · total {sum(counts.values())} tokens"
