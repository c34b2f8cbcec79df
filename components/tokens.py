"""Token view: the whole session's ids colour-coded by who wrote them, for gr.HighlightedText.

One entry per span (system prompt, user message, model segment, tool output); each span's text is its own
ids decoded, never the history re-tokenized. Cost is one decode per span, so long sessions stay cheap. A model
segment the guide shaped (app.decoding.guide) is split into runs: the model's own tokens, and the guide's ("guide": the
tokens it forced, and those it steered away from the model's first choice), each run decoded on its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from app.episode import Provenance, Segment, Span

ROLES = ("system", "user", "model", "guide", "tool")
COLOR_MAP = {"system": "#9ca3af", "user": "#60a5fa", "model": "#34d399", "guide": "#c084fc", "tool": "#fbbf24"}
GUIDED = (Provenance.FORCED, Provenance.STEERED)  # the token view's "guide": the tokens the guide chose


def guided_spans(spans: Sequence[Span], segments: Iterable[Segment]) -> list[Span]:
    """`spans` (Session.spans) with each model span split where its segment's tokens change hands: runs of the
    model's own tokens stay "model", runs of forced or steered ones become "guide" (a role of the view only).
    A span without a segment of the same extent, or tokens past its recorded provenance, stay the model's."""
    by_extent = {(s.start, s.end): s for s in segments if s.kind == "model"}
    out: list[Span] = []
    for span in spans:
        segment = by_extent.get((span.start, span.end)) if span.role == "model" else None
        if segment is None or segment.provenance is None:
            out.append(span)
            continue
        chosen = segment.token_provenance()
        roles = ["guide" if i < len(chosen) and chosen[i] in GUIDED else "model" for i in range(span.end - span.start)]
        start = span.start
        for i in range(1, len(roles) + 1):
            if i == len(roles) or roles[i] != roles[i - 1]:
                out.append(Span(roles[i - 1], start, span.start + i))  # type: ignore[arg-type]  # (the view's role)
                start = span.start + i
    return out


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
